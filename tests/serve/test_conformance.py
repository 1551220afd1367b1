"""OpenAI conformance: ids unique across requests and server starts (uuid-based),
system_fingerprint in every body and chunk, finish_reason only "stop" or "length", and the eos
that ends a request kept out of the extension's visible token ids (streamed or not)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from serve_helpers import MODEL, RawStream, Served, make_engine, post_json, serve

from tokencache_serve.tiny import words

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = [[5 + (7 * i + 3 * j) % 90 for j in range(4 + i % 5)] for i in range(12)]
FP = re.compile(r"^fp_[0-9a-f]{10}$")


@pytest.fixture(scope="module")
def served(tiny: Any) -> Iterator[Served]:
    with serve(tiny) as s:
        yield s


def chat_body(content: str, stream: bool) -> dict[str, Any]:
    msgs = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": msgs, "max_tokens": 12, "temperature": 0, "stream": stream}


def stream_events(s: Served, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = RawStream(s.server.host, s.server.port, path, body)
    raw.read_events(10_000)
    events = raw.events()
    raw.close()
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_ids_are_unique_and_fingerprinted(served: Served, tiny: Any) -> None:
    ids, fps = [], set()
    for p in PROMPTS[:4]:
        status, r = post_json(served.url, C, {"model": MODEL, "prompt": p, "max_tokens": 2})
        assert status == 200
        ids.append(r["id"])
        fps.add(r["system_fingerprint"])
        chunks = stream_events(
            served,
            CHAT,
            {**chat_body(words(p), True), "stream_options": {"include_usage": True}},
        )
        assert len({c["id"] for c in chunks}) == 1  # one id per response, on every chunk
        ids.append(chunks[0]["id"])
        fps |= {c["system_fingerprint"] for c in chunks}  # the role and usage chunks too
    # a second server starts over at rid 0: its ids must still be new
    with serve(tiny) as other:
        status, r = post_json(other.url, C, {"model": MODEL, "prompt": [5], "max_tokens": 2})
        ids.append(r["id"])
        fps.add(r["system_fingerprint"])
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"(cmpl|chatcmpl)-[0-9a-f]{32}", i) for i in ids)
    ((fp,),) = [fps]  # same model and version: same fingerprint
    assert FP.match(fp)


def test_finish_reasons_are_openai_values(served: Served) -> None:
    seen = set()
    for i, p in enumerate(PROMPTS):
        body = {"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0}
        if i % 3 == 0:
            body["stop"] = ["t1", "t2 t3"]
        status, r = post_json(served.url, C, body)
        assert status == 200
        seen.add(r["choices"][0]["finish_reason"])
        for c in stream_events(served, C, {**body, "stream": True}):
            seen |= {ch["finish_reason"] for ch in c["choices"]}
    assert seen - {None} <= {"stop", "length"}
    assert "length" in seen


def test_no_eos_in_the_visible_extension(served: Served, tiny: Any) -> None:
    tok = served.tokenizer
    eos = tok.eos_token_id
    contents = [words(p) for p in PROMPTS]
    prompts = [
        list(
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
        )
        for c in contents
    ]
    ref = make_engine(tiny).generate(prompts, 12)
    ended_by_eos = [i for i, t in enumerate(ref.tokens) if t and t[-1] == eos]
    assert ended_by_eos, "the tiny pair ends some of these chats with eos"
    for i in ended_by_eos:
        status, r = post_json(served.url, CHAT, chat_body(contents[i], False))
        assert status == 200
        (choice,) = r["choices"]
        assert choice["finish_reason"] == "stop"
        assert choice["tokencache"]["token_ids"] == ref.tokens[i][:-1]
        assert len(choice["tokencache"]["large_token_mask"]) == len(ref.tokens[i]) - 1
        assert r["usage"]["completion_tokens"] == len(ref.tokens[i])
        chunks = stream_events(served, CHAT, chat_body(contents[i], True))
        streamed = [t for c in chunks[1:] for t in c["choices"][0]["tokencache"]["token_ids"]]
        assert streamed == ref.tokens[i][:-1] and eos not in streamed
        last = chunks[-1]["choices"][0]
        assert last["finish_reason"] == "stop" and eos not in last["tokencache"]["token_ids"]
