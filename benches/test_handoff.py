"""One hand-off on the MISSION trace: cursors against the SGLang way, from Python.

Each round: the request (its path ~L/20 nodes deep) hands its cache ~20 fresh tokens.
Run with `pytest benches/test_handoff.py --benchmark-enable`; with --benchmark-disable every
benchmark runs once as a smoke test.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tokencache_bench.benchkit import (
    HANDOFF_TOKENS,
    ROUNDS,
    Fresh,
    fill_sglang_way,
    fill_with_cursors,
    mission_trace,
    round_counter,
)


@pytest.mark.parametrize("gen_len", [512, 8192])
def test_cursor_handoff(benchmark: Any, tokencache_mod: Any, gen_len: int) -> None:
    """Resume a paused request's cursor, extend ~20 tokens, move its pin: one call."""
    trace = mission_trace(gen_len)
    tree, cursors = fill_with_cursors(tokencache_mod, trace)
    base = cursors[0].node
    fresh, nxt = Fresh(trace), round_counter()
    live: list[Any] = []

    def setup() -> tuple[tuple[Any, np.ndarray, np.ndarray], dict[str, Any]]:
        # A paused request: a cursor already pinned at its tail (untimed).
        for c in live:
            c.release()
        live[:] = [tree.cursor_at(base)]
        i = nxt()
        return (live[0], fresh.tokens[i], fresh.slots[i]), {}

    def handoff(cursor: Any, tokens: np.ndarray, slots: np.ndarray) -> None:
        cursor.extend(tokens, slots)

    benchmark.pedantic(handoff, setup=setup, rounds=ROUNDS, iterations=1)
    assert live[0].length == trace.prompt_len + gen_len + HANDOFF_TOKENS
    tree.check_invariants()


@pytest.mark.parametrize("gen_len", [512, 8192])
def test_sglang_way_handoff_tokencache(benchmark: Any, tokencache_mod: Any, gen_len: int) -> None:
    """The same hand-off as SGLang re-admits it, through tokencache.RadixTree:
    match_prefix from the root, lock, insert the whole sequence, unlock."""
    trace = mission_trace(gen_len)
    tree, cursors = fill_with_cursors(tokencache_mod, trace)
    for c in cursors:
        c.release()  # a returning SGLang request holds no pin while away
    seq, seq_slots = trace.tokens[0], trace.slots[0]
    fresh, nxt = Fresh(trace), round_counter()

    def setup() -> tuple[tuple[np.ndarray, np.ndarray], dict[str, Any]]:
        i = nxt()
        tokens = np.concatenate([seq, fresh.tokens[i]])
        return (tokens, np.concatenate([seq_slots, fresh.slots[i]])), {}

    def handoff(tokens: np.ndarray, slots: np.ndarray) -> None:
        m = tree.match_prefix(tokens)
        tree.lock(m.node)
        tree.insert(tokens, slots)
        tree.unlock(m.node)

    benchmark.pedantic(handoff, setup=setup, rounds=ROUNDS, iterations=1)
    assert tree.protected_size() == 0
    tree.check_invariants()


@pytest.mark.parametrize("gen_len", [512, 8192])
def test_sglang_way_handoff_sglang_radixcache(
    benchmark: Any, sglang_radix: Any, gen_len: int
) -> None:
    """The same hand-off through SGLang 0.5.23's Python RadixCache. Its tree is filled from the
    first 2 requests only (filling 32 at L=8192 takes ~30 s); its cost per hand-off depends
    on the path depth, not on the number of requests."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    rc = sglang_radix
    alloc = SimpleNamespace(device="cpu", free=lambda i: None, free_segment=lambda i, **k: None)
    cache = rc.RadixCache.create_simulated(mock_allocator=alloc, page_size=1)
    trace = mission_trace(gen_len, requests=2)

    def key(tokens: np.ndarray) -> Any:
        ids = array("q")  # fresh per call: SGLang's tree may keep the caller's array
        ids.frombytes(tokens.tobytes())
        return rc.RadixKey(ids)

    fill_sglang_way(
        lambda t: cache.match_prefix(MatchPrefixParams(key=key(t))).last_device_node,
        cache.lock,
        lambda t, s: cache.insert(InsertParams(key=key(t), value=torch.from_numpy(s))),
        cache.unlock,
        trace,
    )
    seq, seq_slots = trace.tokens[0], trace.slots[0]
    fresh, nxt = Fresh(trace), round_counter()

    def setup() -> tuple[tuple[Any, Any], dict[str, Any]]:
        i = nxt()
        tokens = np.concatenate([seq, fresh.tokens[i]])
        slots = torch.from_numpy(np.concatenate([seq_slots, fresh.slots[i]]))
        return (MatchPrefixParams(key=key(tokens)), InsertParams(key=key(tokens), value=slots)), {}

    def handoff(match_params: Any, insert_params: Any) -> None:
        m = cache.match_prefix(match_params)
        held = cache.lock(m.last_device_node)
        cache.insert(insert_params)
        cache.unlock(held)

    benchmark.pedantic(handoff, setup=setup, rounds=ROUNDS, iterations=1)
    assert cache.protected_size() == 0


def test_extend_many_256(benchmark: Any, tokencache_mod: Any) -> None:
    """256 paused requests (L=512 each) hand off ~20 tokens each in one extend_many call,
    steady state (each round's extension is truncated away before the next)."""
    requests, gen_len = 256, 512
    trace = mission_trace(gen_len, requests=requests)
    tree, cursors = fill_with_cursors(tokencache_mod, trace)
    bases = [c.node for c in cursors]
    for c in cursors:
        c.release()
    rng = np.random.default_rng(7)
    width = HANDOFF_TOKENS
    base_slot = max(int(s.max()) for s in trace.slots) + 1
    offsets = np.arange(0, (requests + 1) * width, width, dtype=np.int64)
    nxt = round_counter()
    live: list[Any] = []

    def setup() -> tuple[tuple[list[Any], np.ndarray, np.ndarray], dict[str, Any]]:
        # Undo the previous round (untimed) so the tree keeps its size: a tree that only grows
        # would time fresh-memory page faults rather than the tree.
        for c in live:
            c.truncate(width)
            c.release()
        live[:] = [tree.cursor_at(b) for b in bases]
        i = nxt()
        tokens = rng.integers(0, trace.config.vocab, requests * width, dtype=np.int64)
        start = base_slot + i * requests * width
        slots = np.arange(start, start + requests * width, dtype=np.int64)
        return (list(live), tokens, slots), {}

    def step(batch: list[Any], tokens: np.ndarray, slots: np.ndarray) -> None:
        tree.extend_many(batch, offsets, tokens, slots)

    benchmark.pedantic(step, setup=setup, rounds=ROUNDS // 4, iterations=1)
    assert all(c.length == trace.prompt_len + gen_len + width for c in live)
    tree.check_invariants()
