"""One model's side of the engine: its CausalLM, KVPool, RadixTree and slot table, plus
per-request KV handles.

A handle knows which KV slots hold a request's first `length` tokens in this model: they are
its row of the side's SlotTable (written once at admission, appended by each forward), which
the kernels read in place. The tokencache handle is a Cursor: parking costs nothing and
resuming appends only the new tokens. Every tree call is timed into `bookkeeping_s` (the
bookkeeping share of step time).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

import tokencache
from tokencache_models import CausalLM, Epilogue, KVPool
from tokencache_models.parallel.runtime import make_slot_table

if TYPE_CHECKING:
    from .routers import Router

_log = logging.getLogger("tokencache_routing")

# A side's slot table starts this size and doubles (rows, and columns up to the pool's size).
TABLE_ROWS = 64
TABLE_WIDTH = 4096


class BookkeepingTimer:
    """ModelSide.bookkeeping's context: the tree call's time (device synchronised on CUDA)
    added to the side's totals. A class, not a generator-based context manager: it runs
    around a tree call several times a step, and a generator's protocol costs about twice
    the Python calls. Its syncs only time the call (ModelSide.timing_sync): one that fails
    never undoes the call or the bookkeeping after it (a release's row and tail, a pin)."""

    __slots__ = ("op", "side", "t0")

    def __init__(self, side: ModelSide, op: str) -> None:
        self.side, self.op = side, op

    def __enter__(self) -> None:
        side = self.side
        side.timing_sync()
        self.t0 = side.timer()

    def __exit__(self, *exc: object) -> None:
        side = self.side
        side.timing_sync()
        dt = side.timer() - self.t0
        side.bookkeeping_s += dt
        side.bookkeeping_by_op[self.op] = side.bookkeeping_by_op.get(self.op, 0.0) + dt


class ModelSide:
    """One model's side: its model, KV pool, slot table and bookkeeping timers, and its prefix
    cache, a tokencache RadixTree (`tree`). A side over another prefix cache (SGLangSide in
    naive_sglang.py) builds the rest with `_setup` and overrides the cache methods below
    (evict, cached_prefix_len, cached_size, pinned_size, check_invariants)."""

    def __init__(
        self, name: str, model: CausalLM, pool: KVPool, page_size: int = 1, events: bool = False
    ) -> None:
        self._setup(name, model, pool, page_size)
        # events: the tree records stored / removed pages (take_events), for KV-event publishers
        self.tree = tokencache.RadixTree(page_size=page_size, enable_events=events)

    def _setup(self, name: str, model: CausalLM, pool: KVPool, page_size: int) -> None:
        """Everything but the prefix cache."""
        self.name = name
        self.model = model
        self.pool = pool
        self.page_size = page_size  # the prefix cache's page (the scheduler's hold-back reads it)
        # A tensor-parallel model's table also records its writes for the worker ranks.
        self.table = make_slot_table(
            model, TABLE_ROWS, min(TABLE_WIDTH, pool.num_slots), pool, max_width=pool.num_slots
        )
        # The ids sampled and routed over (the engine's: both models' shared vocabulary).
        self.vocab_size = model.config.vocab_size
        self._epilogues: dict[tuple[int, bool, float | None], Epilogue] = {}
        self.bookkeeping_s = 0.0
        # The same time by tree operation (match, lock, insert, unlock, extend, release,
        # evict): the published per-step breakdown is in these terms.
        self.bookkeeping_by_op: dict[str, float] = {}
        # Forwards by path (ModelExecutor.path_of: "extend graph", "decode eager", ...): the
        # share of forwards replayed from CUDA graphs, published in Stats.forward_paths.
        self.forward_paths: Counter[str] = Counter()
        # Measuring on CUDA: synchronise around tree calls, so device work a tree enqueues (as
        # SGLang's does) is charged to bookkeeping, not to the next forward.
        self.sync_cuda = False
        self.sync_errors = 0  # timing syncs the device refused (timing_sync): measurements lost
        # The GPU clock charges bookkeeping as host time: measured as this thread's CPU time,
        # so other processes on a shared machine do not inflate it.
        self.timer: Callable[[], float] = time.perf_counter

    def epilogue(self, router: Router | None = None) -> Epilogue:
        """What this side's forwards compute from their logits on the device: each row's
        greedy token over the shared vocabulary, the entropy when the router reads it, and
        the router's answer when that is an entropy threshold (Router.device_threshold)."""
        entropy = "entropy" in getattr(router, "device_features", ())  # any router object
        threshold = getattr(router, "device_threshold", None)
        at = threshold() if entropy and threshold is not None else None
        key = (self.vocab_size, entropy, at)
        e = self._epilogues.get(key)
        if e is None:
            e = self._epilogues[key] = Epilogue(self.vocab_size, entropy, at)
        return e

    def sync(self) -> None:
        """Measuring on CUDA: waits for the work this thread queued on the model's device (its
        current stream), never for the whole device. In the threaded driver the other worker
        may be capturing a CUDA graph meanwhile: a device-wide synchronize would wait for its
        forwards too, and during a capture on the same device CUDA refuses it and invalidates
        that capture."""
        if self.sync_cuda:
            torch.cuda.current_stream(self.model.device).synchronize()

    def timing_sync(self) -> None:
        """sync() for a tree call's timing only: a failure loses that measurement (counted in
        sync_errors), not the call; a device error that persists fails the next forward."""
        try:
            self.sync()
        except Exception as e:
            self.sync_errors += 1
            if self.sync_errors == 1:
                _log.warning(
                    "%s side: a timing sync failed (%r), timings may be short", self.name, e
                )

    def bookkeeping(self, op: str = "other") -> BookkeepingTimer:
        """`with side.bookkeeping(op):` times a tree call into bookkeeping_s (by op)."""
        return BookkeepingTimer(self, op)

    def alloc(self, n: int) -> np.ndarray:
        return self.pool.alloc_array(n)

    def free(self, slots: np.ndarray | torch.Tensor) -> None:
        if len(slots):
            self.pool.free(slots)

    def evict(self, n: int) -> int:
        with self.bookkeeping("evict"):
            slots = self.tree.evict(n)
        self.free(slots)
        return len(slots)

    def cached_prefix_len(self, tokens: np.ndarray) -> int:
        """How many leading tokens this side's prefix cache holds (timed as a match). Read
        only: asking (the hold-back asks it of every first forward) neither splits a node nor
        counts as a use for eviction, and copies no slots out."""
        with self.bookkeeping("match"):
            return self.tree.cached_prefix_len(tokens)

    def cached_size(self) -> int:
        return int(self.tree.total_size())

    def pinned_size(self) -> int:
        return int(self.tree.protected_size())

    def check_invariants(self) -> None:
        """The prefix cache's own consistency check (raises when broken)."""
        self.tree.check_invariants()

    def idle_invariant(self) -> bool:
        """At idle every slot is free or cached in the tree, nothing is pinned and no slot-table
        row is held."""
        free_or_cached = self.pool.available + self.cached_size() == self.pool.num_slots
        return free_or_cached and self.pinned_size() == 0 and self.table.rows_held == 0


class KVHandle(Protocol):
    """Which KV slots of one model hold a request's first `length` tokens."""

    @property
    def attached(self) -> bool: ...

    @property
    def length(self) -> int: ...

    @property
    def row(self) -> int: ...

    def attach(self, seq: np.ndarray) -> None: ...

    def slots(self) -> np.ndarray: ...

    def park(self, seq: np.ndarray) -> None: ...

    def release(self, seq: np.ndarray) -> None: ...

    @staticmethod
    def commit_many(
        side: ModelSide,
        handles: Sequence[KVHandle],
        offsets: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
    ) -> None: ...


class SlotRow:
    """A request's row in its model's slot table: the KV slots of its first `length` tokens.
    Shared by every handle kind; what differs between them is the tree protocol around it."""

    def __init__(self, side: ModelSide) -> None:
        self.side = side
        self._row = -1
        self._n = 0

    @property
    def row(self) -> int:
        return self._row

    @property
    def length(self) -> int:
        return self._n

    def slots(self) -> np.ndarray:
        """A view of the row's first `length` slots (no copy)."""
        return self.side.table.row(self._row, self._n)

    def _take_row(self, matched: np.ndarray) -> None:
        """Admission: a fresh row holding the matched prefix's slots (written once)."""
        table = self.side.table
        self._row = table.acquire()
        table.write(self._row, 0, matched)
        self._n = len(matched)

    def _committed(self, n: int) -> None:
        """n more tokens are this request's: prepare_forward wrote their slots already."""
        self._n += n

    @staticmethod
    def committed_many(handles: Sequence[SlotRow], offsets: np.ndarray) -> None:
        """_committed for a batch: handle i took offsets[i + 1] - offsets[i] more tokens."""
        lens = offsets[1:] - offsets[:-1]  # np.diff, without its wrappers
        for h, n in zip(handles, lens.tolist(), strict=True):
            h._n += n

    def _drop_row(self) -> None:
        if self._row >= 0:
            self.side.table.release(self._row)
        self._row = -1
        self._n = 0


class CursorKV(SlotRow):
    """tokencache handle: a Cursor in this model's tree, kept for the request's whole life.

    The slot row is filled from the match at admission, appended by each forward and patched
    where the tree already held a token (Dedup), so a step never copies the whole slot list out
    of the tree.
    """

    needs_attach_each_time = False

    def __init__(self, side: ModelSide) -> None:
        super().__init__(side)
        self.cursor: tokencache.Cursor | None = None

    @property
    def attached(self) -> bool:
        return self.cursor is not None

    def attach(self, seq: np.ndarray) -> None:
        """Pin the longest cached prefix of seq[:-1] (at least one token is left to run)."""
        with self.side.bookkeeping("match"):
            m = self.side.tree.match_prefix(seq[:-1])
        with self.side.bookkeeping("lock"):
            self.cursor = self.side.tree.cursor_at(m.node)
        self._take_row(m.slots)

    @staticmethod
    def commit_many(
        side: ModelSide,
        handles: Sequence[KVHandle],
        offsets: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        """One native extend for the whole batch; duplicates go back to the allocator and the
        rows point at the tree's slots for them instead."""
        mine = cast("Sequence[CursorKV]", handles)  # a batch holds one handle kind
        with side.bookkeeping("extend"):
            cursors = [h.cursor for h in mine if h.cursor is not None]
            if len(cursors) != len(mine):
                raise RuntimeError("commit_many: a handle has no cursor (not attached)")
            dedup = side.tree.extend_many(cursors, offsets, tokens, slots)
        SlotRow.committed_many(mine, offsets)
        if len(dedup):
            rows = np.fromiter((mine[i].row for i in dedup.request.tolist()), np.int64)
            side.table.patch(rows, dedup.positions, dedup.slots)
            side.free(dedup.freed)

    def park(self, seq: np.ndarray) -> None:
        """A request waiting for the other model keeps its cursor: nothing to do."""

    def release(self, seq: np.ndarray) -> None:
        if self.cursor is None:
            return
        with self.side.bookkeeping("unlock"):
            tail = self.cursor.release()
        self.cursor = None
        self._drop_row()
        self.side.free(tail)


def forward_paths(sides: Sequence[ModelSide]) -> dict[str, int]:
    """Every side's forwards by path, keyed "<side> <path>" (Stats.forward_paths)."""
    return {f"{side.name} {path}": n for side in sides for path, n in side.forward_paths.items()}
