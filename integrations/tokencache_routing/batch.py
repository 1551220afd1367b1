"""Batch selection helpers and the batched forward over a model side (used by the scheduler)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokencache_models import ForwardOutput, HostBatch

from .clock import NO_PREFIX, PrefixRead
from .kv import KVHandle, ModelSide
from .state import Request


def overlaps_prefill(
    r: Request,
    running: Sequence[Request],
    kind: int,
    page_size: int,
    cached: Callable[[Request], int] | None = None,
) -> bool:
    """True when r shares at least a page of prefix that is not cached yet with a request
    whose prefill in this model has not run yet: admitted together, both would prefill it (the
    duplicate freed afterwards), so r waits one step and then matches the first one's KV in the
    tree instead. cached(r): how much of r the tree already holds (asked only on an overlap)."""
    known = -1
    for q in running:
        if q.kv[kind].attached:
            continue
        m = min(r.n, q.n) - 1  # attach matches seq[:-1]
        if m < page_size:
            continue
        diff = np.flatnonzero(r.seq[:m] != q.seq[:m])
        common = diff[0] if len(diff) else m
        if common < page_size:
            continue
        if known < 0:
            known = cached(r) if cached is not None else 0
        if common >= known + page_size:
            return True
    return False


def take_catchup_batch(
    parked: Sequence[Request],
    cap: int,
    kind: int,
    page_size: int,
    cached: Callable[[Request], int] | None = None,
) -> tuple[list[Request], list[Request], list[Request]]:
    """Splits parked requests into (catch-up batch, left parked, held back). A request
    making its first forward in this model (handle not attached) that shares at least a page of
    uncached prefix with another one being attached in this batch is held for the next batch,
    where it matches the first one's KV in the tree instead of prefilling the prefix again. A
    request held once is never held again (no starvation); parked order is kept."""
    batch: list[Request] = []
    rest: list[Request] = []
    held: list[Request] = []
    for r in parked:
        if len(batch) >= cap:
            rest.append(r)
        elif (
            r.held_catchup
            or r.kv[kind].attached
            or not overlaps_prefill(r, batch, kind, page_size, cached)
        ):
            r.held_catchup = False
            batch.append(r)
        else:
            r.held_catchup = True
            rest.append(r)
            held.append(r)
    return batch, rest, held


def attach_all(batch: Sequence[Request], kind: int) -> None:
    """Admission into this model: pin the longest cached prefix (first forward here)."""
    for r in batch:
        h = r.kv[kind]
        if not h.attached:
            h.attach(r.seq[: r.n])


def tokens_needed(batch: Sequence[Request], kind: int) -> int:
    return sum(r.n - r.kv[kind].length for r in batch)


@dataclass
class PreparedForward:
    """One forward's inputs with its new KV slots allocated. Whoever prepares it must end it
    with commit() (the handles take the slots) or discard() (the slots go back): nothing leaks
    when the forward, the router or a commit raises."""

    side: ModelSide
    batch: list[Request]
    handles: list[KVHandle]
    q_off: np.ndarray
    kv_lens: np.ndarray  # per request: context after this forward
    tokens: np.ndarray
    new_slots: np.ndarray
    host: HostBatch  # the forward over the side's slot-table rows (new slots already in them)
    done: bool = False
    # The prefix groups a shared-prefix runner reads once and their traffic (GpuClock.prefix_of);
    # set by the engine when its GPU clock models one (NO_PREFIX: none, or not asked)
    shared_prefix: PrefixRead = NO_PREFIX
    # Measured by run() on the side's timer: the time spent inside the forward's device work
    # (the engine's host time for the step is the rest).
    execute_host_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.q_off[-1])

    def run(self) -> tuple[ForwardOutput, float]:
        """The forward; returns its output and its device time (on CUDA synchronised, so the
        GPU time and not the launch time). The runner's host preparation before it is host
        time of the step, like the scheduling around it."""
        model, timer = self.side.model, self.side.timer
        step = model.prepare(self.host, self.side.pool)
        t1, w1 = timer(), time.perf_counter()
        out = model.execute(step)
        self.side.sync()
        w2 = time.perf_counter()
        self.execute_host_s = timer() - t1
        if out.logits.shape[-1] > self.side.vocab_size:  # a model's padding rows: never drawn
            out = dataclasses.replace(out, logits=out.logits[:, : self.side.vocab_size])
        return out, w2 - w1

    def commit(self) -> None:
        """Handles extended in one call (duplicates of cached tokens freed by the handles)."""
        if self.done:
            raise RuntimeError("forward already committed or discarded")
        self.handles[0].commit_many(
            self.side, self.handles, self.q_off, self.tokens, self.new_slots
        )
        self.done = True

    def discard(self) -> None:
        if not self.done:
            self.done = True
            self.side.free(self.new_slots)


def prepare_forward(side: ModelSide, batch: Sequence[Request], kind: int) -> PreparedForward:
    """A forward over every request's tokens not yet in this model's KV (room already made).
    O(batch + new tokens): the new slots are appended to the requests' slot-table rows, which
    the runner reads in place; nothing is copied per context token."""
    n = len(batch)
    handles = [r.kv[kind] for r in batch]
    starts = np.fromiter((h.length for h in handles), np.int64, n)
    ends = np.fromiter((r.n for r in batch), np.int64, n)
    rows = np.fromiter((h.row for h in handles), np.int64, n)
    q_lens = ends - starts
    q_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=q_off[1:])
    total = int(q_off[-1])
    if total == n:  # decode: each request's last token at its last position
        tokens = np.fromiter((r.seq[r.n - 1] for r in batch), np.int64, n)
        positions, token_rows = starts, rows
    else:
        tokens = np.concatenate([r.seq[s:e] for r, s, e in zip(batch, starts, ends, strict=True)])
        positions = np.repeat(starts - q_off[:-1], q_lens) + np.arange(total, dtype=np.int64)
        token_rows = np.repeat(rows, q_lens)
    new_slots = side.alloc(total)
    side.table.scatter(token_rows, positions, new_slots)
    host = HostBatch.from_table(side.table, rows, tokens, positions, new_slots, q_off, ends)
    return PreparedForward(side, list(batch), handles, q_off, ends, tokens, new_slots, host)
