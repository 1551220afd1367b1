"""Bounded load on 127.0.0.1: 64 concurrent streaming clients, 128 requests, a time limit. Every
request completes once with the tokens generate() gives for its prompt; afterwards the engine is
idle (every slot free or cached, nothing pinned)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from serve_helpers import MODEL, make_engine, serve

from tokencache_serve.tiny import words

CLIENTS = 64
REQUESTS = 128
MAX_NEW = 16
TIME_LIMIT_S = 240.0
# 8 prompts, two families sharing a 6-token prefix (the trees share their KV)
PROMPTS = [[9, 10, 11, 12, 13, 14, *[20 + 3 * i + j for j in range(1 + i % 4)]] for i in range(4)]
PROMPTS += [[40, 41, 42, 43, 44, 45, *[60 + 5 * i + j for j in range(2 + i % 3)]] for i in range(4)]


def chat_ids(tok: Any, content: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return list(tok.encode(text, add_special_tokens=False))


async def one(client: Any, j: int) -> dict[str, Any]:
    """Request j: even j through /v1/completions, odd j through chat; always streaming."""
    p = PROMPTS[j % len(PROMPTS)]
    text, tokens, ids, reasons = "", [], set(), []
    if j % 2 == 0:
        stream = await client.completions.create(
            model=MODEL, prompt=p, max_tokens=MAX_NEW, temperature=0, stream=True
        )
    else:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": words(p)}],
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
        )
    async for chunk in stream:
        ids.add(chunk.id)
        choice = chunk.choices[0]
        text += choice.text if j % 2 == 0 else (choice.delta.content or "")
        tokens += (choice.model_extra or {}).get("tokencache", {}).get("token_ids", [])
        reasons.append(choice.finish_reason)
    return {"j": j, "text": text, "tokens": tokens, "ids": ids, "reason": reasons[-1]}


async def run_load(client: Any) -> list[dict[str, Any]]:
    todo = list(range(REQUESTS))
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        while todo:
            results.append(await one(client, todo.pop()))

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CLIENTS))), TIME_LIMIT_S)
    return results


def test_64_concurrent_streaming_clients(tiny: Any) -> None:
    tok = tiny[2]
    ref = make_engine(tiny).generate(PROMPTS, MAX_NEW)
    ref_chat = make_engine(tiny).generate([chat_ids(tok, words(p)) for p in PROMPTS], MAX_NEW)
    with serve(tiny, max_running=32) as served:
        t0 = time.perf_counter()
        results = asyncio.run(run_load(served.async_client()))
        elapsed = time.perf_counter() - t0
        # every request answered exactly once, none lost or duplicated
        assert sorted(r["j"] for r in results) == list(range(REQUESTS))
        all_ids = [i for r in results for i in r["ids"]]
        assert all(len(r["ids"]) == 1 for r in results)
        assert len(set(all_ids)) == REQUESTS
        # each got exactly its own prompt's output (no tokens crossed between requests)
        for r in results:
            k = r["j"] % len(PROMPTS)
            want = ref if r["j"] % 2 == 0 else ref_chat
            assert r["tokens"] == want.tokens[k], r["j"]
            assert r["text"] == tok.decode(want.tokens[k], skip_special_tokens=True)
            assert r["reason"] == want.finished_reasons[k]
        assert len(served.handles) == REQUESTS
        assert len({h.rid for h in served.handles}) == REQUESTS
        served.wait_idle()
        m = served.engine.metrics()
        assert m["requests_submitted"] == REQUESTS
        assert m["tokens_generated"] == sum(len(r["tokens"]) for r in results)
        assert m["small_kv_slots_free"] + m["small_kv_slots_cached"] == m["small_kv_slots_total"]
        assert m["large_kv_slots_free"] + m["large_kv_slots_cached"] == m["large_kv_slots_total"]
    assert elapsed < TIME_LIMIT_S
    print(f"{REQUESTS} requests, {CLIENTS} clients: {elapsed:.1f} s")
