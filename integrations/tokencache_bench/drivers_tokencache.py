"""Drivers for tokencache: the SGLang way, with cursors, and with batched cursors."""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import numpy as np

from tokencache_bench.driver import Driver
from tokencache_bench.trace import HandOff, Trace


class TokencacheRadixTree(Driver):
    """tokencache.RadixTree re-admitting each returning request exactly as SGLang would."""

    name = "tokencache RadixTree (SGLang way)"
    ops = ("match", "lock", "insert", "unlock")

    def __init__(self, trace: Trace) -> None:
        super().__init__(trace)
        import tokencache

        self.tree = tokencache.RadixTree(page_size=1)

    def admit(self, request: int) -> None:
        self._run(request, self.trace.prompt_len)

    def handoff(self, h: HandOff) -> tuple[int, ...]:
        return self._run(h.request, h.end)

    def _run(self, request: int, end: int) -> tuple[int, ...]:
        tree = self.tree
        tokens = self.trace.tokens[request][:end]
        slots = self.trace.slots[request][:end]
        t0 = perf_counter_ns()
        m = tree.match_prefix(tokens)
        t1 = perf_counter_ns()
        tree.lock(m.node)
        t2 = perf_counter_ns()
        tree.insert(tokens, slots)
        t3 = perf_counter_ns()
        tree.unlock(m.node)
        t4 = perf_counter_ns()
        return (t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    def cached_tokens(self) -> int:
        return int(self.tree.total_size())


class TokencacheCursors(Driver):
    """One tokencache.Cursor per request; a hand-off is one cursor.extend of the new tokens."""

    name = "tokencache cursors"
    ops = ("extend",)

    def __init__(self, trace: Trace) -> None:
        super().__init__(trace)
        import tokencache

        self.tree = tokencache.RadixTree(page_size=1)
        self.cursors: list[Any] = []

    def admit(self, request: int) -> None:
        cursor = self.tree.cursor()
        n = self.trace.prompt_len
        cursor.extend(self.trace.tokens[request][:n], self.trace.slots[request][:n])
        self.cursors.append(cursor)

    def handoff(self, h: HandOff) -> tuple[int, ...]:
        cursor = self.cursors[h.request]
        tokens = self.trace.tokens[h.request][h.start : h.end]
        slots = self.trace.slots[h.request][h.start : h.end]
        t0 = perf_counter_ns()
        cursor.extend(tokens, slots)
        t1 = perf_counter_ns()
        return (t1 - t0,)

    def cached_tokens(self) -> int:
        return int(self.tree.total_size())

    def close(self) -> None:
        for cursor in self.cursors:
            cursor.release()


class TokencacheExtendMany(TokencacheCursors):
    """All hand-offs of a decode step in one tree.extend_many call."""

    name = "tokencache cursors, extend_many"
    ops = ("step",)
    batched = True

    def step(self, handoffs: list[HandOff]) -> int:
        # Gathering the step's tokens is the engine's job (it holds them in one buffer already),
        # so it stays outside the timed call.
        cursors = [self.cursors[h.request] for h in handoffs]
        lengths = np.array([h.end - h.start for h in handoffs], dtype=np.int64)
        offsets = np.zeros(len(handoffs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate([self.trace.tokens[h.request][h.start : h.end] for h in handoffs])
        slots = np.concatenate([self.trace.slots[h.request][h.start : h.end] for h in handoffs])
        t0 = perf_counter_ns()
        self.tree.extend_many(cursors, offsets, tokens, slots)
        return perf_counter_ns() - t0
