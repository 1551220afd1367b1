"""Helpers for benches/: trees pre-filled from the MISSION trace and fresh hand-off payloads.

The MISSION trace: 32 requests behind a 512-token shared system prompt, 5% escalation per step,
so the tree holds one node per ~20-token hand-off and a request's path is ~L/20 nodes deep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokencache_bench.trace import Trace, TraceConfig, make_trace

HANDOFF_TOKENS = 20  # ~1/p at p = 0.05
ROUNDS = 200


def mission_trace(gen_len: int, requests: int = 32) -> Trace:
    return make_trace(TraceConfig(requests=requests, max_gen=gen_len, buckets=(gen_len,)))


@dataclass
class Fresh:
    """Never-seen hand-off payloads: each round appends new tokens (a new sibling leaf at the
    same depth), so every round sees the same tree depth and no round re-finds its tokens."""

    tokens: np.ndarray  # (rounds, HANDOFF_TOKENS) int64
    slots: np.ndarray  # (rounds, HANDOFF_TOKENS) int64, above every slot of the trace

    def __init__(self, trace: Trace, rounds: int = ROUNDS, width: int = HANDOFF_TOKENS) -> None:
        rng = np.random.default_rng(12345)
        self.tokens = rng.integers(0, trace.config.vocab, (rounds, width), dtype=np.int64)
        base = max(int(s.max()) for s in trace.slots) + 1
        self.slots = np.arange(base, base + rounds * width, dtype=np.int64).reshape(rounds, width)


def round_counter() -> Callable[[], int]:
    """Setup helper: the index of the next round (wraps, so --benchmark-disable and long
    calibrations both stay in range)."""
    state = {"i": -1}

    def nxt() -> int:
        state["i"] = (state["i"] + 1) % ROUNDS
        return state["i"]

    return nxt


def fill_with_cursors(tokencache: Any, trace: Trace) -> tuple[Any, list[Any]]:
    """A tokencache tree holding the whole trace, one live cursor per request."""
    tree = tokencache.RadixTree(page_size=1)
    cursors = []
    for r in range(trace.requests):
        cursor = tree.cursor()
        n = trace.prompt_len
        cursor.extend(trace.tokens[r][:n], trace.slots[r][:n])
        cursors.append(cursor)
    for h in trace.handoffs:
        cursors[h.request].extend(
            trace.tokens[h.request][h.start : h.end], trace.slots[h.request][h.start : h.end]
        )
    return tree, cursors


def fill_sglang_way(
    match: Callable[[np.ndarray], Any],
    lock: Callable[[Any], Any],
    insert: Callable[[np.ndarray, np.ndarray], Any],
    unlock: Callable[[Any], Any],
    trace: Trace,
) -> None:
    """Fill any SGLang-style tree by re-admitting each request at every hand-off."""
    ends = [(r, trace.prompt_len) for r in range(trace.requests)]
    ends += [(h.request, h.end) for h in trace.handoffs]
    for r, end in ends:
        node = match(trace.tokens[r][:end])
        held = lock(node)
        insert(trace.tokens[r][:end], trace.slots[r][:end])
        unlock(held)
