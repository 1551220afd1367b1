"""One model's side of the engine: its CausalLM, KVPool and RadixTree, plus per-request KV handles.

A handle knows which KV slots hold a request's first `length` tokens in this model. The
tokencache handle is a Cursor: parking costs nothing and resuming appends only the new tokens.
Every tokencache call is timed into `bookkeeping_s` (the bookkeeping share of step time).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch

import tokencache
from tokencache_models import CausalLM, KVPool


class ModelSide:
    def __init__(self, name: str, model: CausalLM, pool: KVPool, page_size: int = 1) -> None:
        self.name = name
        self.model = model
        self.pool = pool
        self.tree = tokencache.RadixTree(page_size=page_size)
        self.bookkeeping_s = 0.0
        # The same time by tree operation (match, lock, insert, unlock, extend, release,
        # evict): the published per-step breakdown is in these terms.
        self.bookkeeping_by_op: dict[str, float] = {}
        # Measuring on CUDA: synchronise around tree calls, so device work a tree enqueues (as
        # SGLang's does) is charged to bookkeeping, not to the next forward.
        self.sync_cuda = False
        # The GPU clock charges bookkeeping as host time: measured as this thread's CPU time,
        # so other processes on a shared machine do not inflate it.
        self.timer: Callable[[], float] = time.perf_counter

    def sync(self) -> None:
        if self.sync_cuda:
            torch.cuda.synchronize(self.model.device)

    @contextmanager
    def bookkeeping(self, op: str = "other") -> Iterator[None]:
        self.sync()
        t0 = self.timer()
        try:
            yield
        finally:
            self.sync()
            dt = self.timer() - t0
            self.bookkeeping_s += dt
            self.bookkeeping_by_op[op] = self.bookkeeping_by_op.get(op, 0.0) + dt

    def alloc(self, n: int) -> np.ndarray:
        return self.pool.alloc(n).numpy()

    def free(self, slots: np.ndarray | torch.Tensor) -> None:
        if len(slots):
            self.pool.free(torch.as_tensor(slots, dtype=torch.int64))

    def evict(self, n: int) -> int:
        with self.bookkeeping("evict"):
            slots = self.tree.evict(n)
        self.free(slots)
        return len(slots)

    def cached_size(self) -> int:
        return int(self.tree.total_size())

    def pinned_size(self) -> int:
        return int(self.tree.protected_size())

    def idle_invariant(self) -> bool:
        """At idle every slot is free or cached in the tree, and nothing is pinned."""
        free_or_cached = self.pool.available + self.cached_size() == self.pool.num_slots
        return free_or_cached and self.pinned_size() == 0


class KVHandle(Protocol):
    """Which KV slots of one model hold a request's first `length` tokens."""

    @property
    def attached(self) -> bool: ...

    @property
    def length(self) -> int: ...

    def attach(self, seq: np.ndarray) -> None: ...

    def slots(self) -> np.ndarray: ...

    def park(self, seq: np.ndarray) -> None: ...

    def release(self, seq: np.ndarray) -> None: ...


class CursorKV:
    """tokencache handle: a Cursor in this model's tree, kept for the request's whole life.

    The request's slot row (KV slots of its first `length` tokens) is kept here incrementally:
    filled from the match at admission, appended after each extend and patched where the tree
    already held a token (Dedup), so a step never copies the whole slot list out of the tree.
    """

    needs_attach_each_time = False

    def __init__(self, side: ModelSide) -> None:
        self.side = side
        self.cursor: tokencache.Cursor | None = None
        self._row = np.empty(0, dtype=np.int64)
        self._n = 0

    @property
    def attached(self) -> bool:
        return self.cursor is not None

    def attach(self, seq: np.ndarray) -> None:
        """Pin the longest cached prefix of seq[:-1] (at least one token is left to run)."""
        with self.side.bookkeeping("match"):
            m = self.side.tree.match_prefix(seq[:-1])
        with self.side.bookkeeping("lock"):
            self.cursor = self.side.tree.cursor_at(m.node)
            matched = m.slots
        self._row = np.empty(max(16, 2 * len(seq)), dtype=np.int64)
        self._n = len(matched)
        self._row[: self._n] = matched

    @property
    def length(self) -> int:
        return self._n

    def slots(self) -> np.ndarray:
        """A view of the kept row (no copy out of the tree)."""
        return self._row[: self._n]

    def _append(self, slots: np.ndarray) -> None:
        end = self._n + len(slots)
        if end > len(self._row):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[: self._n] = self._row[: self._n]
            self._row = grown
        self._row[self._n : end] = slots
        self._n = end

    @staticmethod
    def commit_many(
        side: ModelSide,
        handles: Sequence[CursorKV],
        offsets: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        """One native extend for the whole batch; duplicates go back to the allocator and the
        rows point at the tree's slots for them instead."""
        with side.bookkeeping("extend"):
            cursors = [h.cursor for h in handles if h.cursor is not None]
            if len(cursors) != len(handles):
                raise RuntimeError("commit_many: a handle has no cursor (not attached)")
            dedup = side.tree.extend_many(cursors, offsets, tokens, slots)
        for i, h in enumerate(handles):
            h._append(slots[offsets[i] : offsets[i + 1]])
        if len(dedup):
            req, pos, tree_slots = dedup.request, dedup.positions, dedup.slots
            for i in np.unique(req):  # one vectorized patch per request, not per token
                sel = req == i
                handles[i]._row[pos[sel]] = tree_slots[sel]
            side.free(dedup.freed)

    def park(self, seq: np.ndarray) -> None:
        """A request waiting for the other model keeps its cursor: nothing to do."""

    def release(self, seq: np.ndarray) -> None:
        if self.cursor is None:
            return
        with self.side.bookkeeping("unlock"):
            tail = self.cursor.release()
        self.cursor = None
        self._n = 0
        self.side.free(tail)
