"""A failure in one request's own work at the server (its detokenization, its stop-string
handling) ends that request alone: it gets a 500 / an error event without the exception's
text, its engine request is aborted, and every request beside it gets exactly the tokens and
text of a clean run (greedy, compared with RoutedEngine.generate), under both engine drivers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serve_helpers import MODEL, RawStream, post_json, serve

from tokencache_serve import generation
from tokencache_serve.textstream import TextStream

MAX_NEW = 24
PROMPTS = [[5 + (11 * i + 5 * j) % 90 for j in range(3 + i % 4)] for i in range(6)]
POISON = "POISON-never-in-the-output"  # a stop string that marks the request to fail


class FaultyTextStream(TextStream):
    """Fails at its third batch of tokens, in decoding ("feed") or in the stop-string hold-back
    ("delta"), for a request whose stop strings include POISON; every other request's stream
    is the real one."""

    fault_in = "feed"

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        super().__init__(tokenizer, stops)
        self.poisoned = POISON in stops
        self.calls = 0

    def _maybe_fail(self, where: str) -> None:
        if self.poisoned and where == self.fault_in:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("planted fault in one request's own work")

    def feed(self, tokens: Sequence[int]) -> int:
        self._maybe_fail("feed")
        return super().feed(tokens)

    def delta(self, final: bool = False) -> str:
        self._maybe_fail("delta")
        return super().delta(final)


def body(prompt: list[int], stream: bool, stop: list[str] | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_NEW}
    b.update(temperature=0, stream=stream)
    if stop:
        b["stop"] = stop
    return b


def stream_tokens(events: list[bytes]) -> tuple[list[int], str, Any]:
    tokens: list[int] = []
    text, last = "", None
    for e in events[:-1]:
        chunk = json.loads(e)
        if "error" in chunk:
            return tokens, text, chunk
        (choice,) = chunk["choices"]
        tokens += choice["tokencache"]["token_ids"]
        text += choice["text"]
        last = choice["finish_reason"]
    return tokens, text, last


@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize("fault_in", ["feed", "delta"])
def test_a_fault_in_one_request_leaves_the_others_identical(
    tiny: Any, monkeypatch: pytest.MonkeyPatch, mode: str, fault_in: str
) -> None:
    from serve_helpers import make_engine

    reference = make_engine(tiny, eos_token_id=None).generate(PROMPTS, MAX_NEW)
    monkeypatch.setattr(FaultyTextStream, "fault_in", fault_in)
    monkeypatch.setattr(generation, "TextStream", FaultyTextStream)
    with serve(tiny, eos_token_id=None, mode=mode, num_slots=4096) as served:
        host, port = served.server.host, served.server.port
        with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
            whole = [
                pool.submit(post_json, served.url, "/v1/completions", body(p, False))
                for p in PROMPTS[:3]
            ]
            raws = [RawStream(host, port, "/v1/completions", body(p, True)) for p in PROMPTS[3:]]
            bad_whole = pool.submit(
                post_json, served.url, "/v1/completions", body([7, 8, 9], False, [POISON])
            )
            bad_raw = RawStream(host, port, "/v1/completions", body([9, 8, 7], True, [POISON]))
            for raw in (*raws, bad_raw):
                raw.read_events(10_000)
            results = [f.result(60) for f in whole]
            bad_status, bad_body = bad_whole.result(60)

        for i, (status, r) in enumerate(results):
            assert status == 200, r
            (choice,) = r["choices"]
            assert choice["tokencache"]["token_ids"] == reference.tokens[i]
            assert choice["tokencache"]["large_token_mask"] == reference.models[i]
            assert choice["finish_reason"] == "length"
        for i, raw in enumerate(raws, start=3):
            tokens, text, last = stream_tokens(raw.events())
            assert tokens == reference.tokens[i] and last == "length"
            assert text == served.tokenizer.decode(reference.tokens[i], skip_special_tokens=True)
            raw.close()

        # the poisoned ones: a 500 / an error event closing the stream, no exception text
        assert bad_status == 500 and bad_body["error"]["type"] == "server_error", bad_body
        assert "planted" not in json.dumps(bad_body)
        events = bad_raw.events()
        assert events[-1] == b"[DONE]"
        _, _, err = stream_tokens(events)
        assert isinstance(err, dict) and err["error"]["type"] == "server_error"
        assert "planted" not in json.dumps(err)
        bad_raw.close()
        served.wait_idle()
        # their engine requests were aborted well before max_tokens
        poisoned = [h for h in served.handles if h.finished_reason == "abort"]
        assert len(poisoned) == 2 and all(len(h.tokens) < MAX_NEW for h in poisoned)
        # and the server goes on serving the same tokens
        status, again = post_json(served.url, "/v1/completions", body(PROMPTS[0], False))
        assert status == 200
        assert again["choices"][0]["tokencache"]["token_ids"] == reference.tokens[0]
