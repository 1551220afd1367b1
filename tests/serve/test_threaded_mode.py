"""The server over the threaded engine (one worker thread per model): the same answers for
requests sent one at a time (batch composition cannot differ), streaming and not; disconnects
abort; the engine ends idle."""

from __future__ import annotations

from typing import Any

from serve_helpers import MODEL, RawStream, make_engine, serve

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]


def test_threaded_engine_serves_the_same_tokens(tiny: Any) -> None:
    # no eos: the long request below would otherwise end by itself (greedy: at its 35th token)
    ref = make_engine(tiny, eos_token_id=None).generate(PROMPTS, 10)
    with serve(tiny, mode="threaded", eos_token_id=None) as served:
        c = served.client()
        for i, p in enumerate(PROMPTS):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0)
            assert r.choices[0].model_extra["tokencache"]["token_ids"] == ref.tokens[i]
            assert r.choices[0].model_extra["tokencache"]["large_token_mask"] == ref.models[i]
            chunks = list(
                c.completions.create(
                    model=MODEL, prompt=p, max_tokens=10, temperature=0, stream=True
                )
            )
            tokens = [
                t for ch in chunks for t in ch.choices[0].model_extra["tokencache"]["token_ids"]
            ]
            assert tokens == ref.tokens[i]
        n = len(served.handles)
        raw = RawStream(
            served.server.host,
            served.server.port,
            "/v1/completions",
            {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True},
        )
        raw.read_events(2)
        raw.close()
        h = served.handles[n]
        assert h.wait(20) and h.finished_reason == "abort" and len(h.tokens) < 400
        served.wait_idle()
