"""Batch selection helpers and the batched forward over a model side (used by the scheduler)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

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
    whose prefill in this model has not run yet (or, chunked, not that far yet): admitted
    together, both would prefill it (the duplicate freed afterwards), so r waits and then
    matches the first one's KV in the tree instead. cached(r): how much of r the tree already
    holds (asked only on an overlap)."""
    known = -1
    for q in running:
        m = min(r.n, q.n) - 1  # attach matches seq[:-1]
        h = q.kv[kind]
        # Attached, q's prefill has run up to h.length (chunked prefill: maybe part of it)
        done = h.length if h.attached else 0
        if m < page_size or done >= m:
            continue
        diff = np.flatnonzero(r.seq[:m] != q.seq[:m])
        common = diff[0] if len(diff) else m
        if common < page_size or common <= done:
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
    request held once is not held again (no starvation), unless behind a catch-up split in
    chunks (partial_prefill) that has not passed the shared prefix yet: that one is first in
    line and advances every catch-up; parked order is kept."""
    batch: list[Request] = []
    rest: list[Request] = []
    held: list[Request] = []
    for r in parked:
        if len(batch) >= cap:
            rest.append(r)
        elif (
            r.kv[kind].attached
            or (r.held_catchup and not any(q.partial_prefill for q in batch))
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


def chunk_ends(batch: Sequence[Request], kind: int, budget: int) -> list[int]:
    """Chunked prefill: per request (attached), the end of this step's tokens in r.seq, so the
    step computes at most `budget` tokens (0: no budget, every request's end is r.n).
    Decode rows (one pending token) go first, in batch order; the rest of the budget goes to
    the longer rows (prefills, catch-ups) in batch order, the last one it reaches taking a
    chunk of its tokens. A row the budget does not reach ends where it starts (no tokens this
    step: the scheduler leaves it out). Progress: when decode rows alone would take the whole
    budget, one token of it is kept for the first longer row, so a budget smaller than the
    batch never starves a prefill."""
    starts = [r.kv[kind].length for r in batch]
    if budget <= 0:
        return [r.n for r in batch]
    ends = list(starts)
    decode = [i for i, r in enumerate(batch) if r.n - starts[i] == 1]
    longer = [i for i, r in enumerate(batch) if r.n - starts[i] > 1]
    left = budget
    for i in decode[: budget - 1 if longer else budget]:
        ends[i] += 1
        left -= 1
    for i in longer:
        if left <= 0:
            break
        take = min(batch[i].n - starts[i], left)
        ends[i] += take
        left -= take
    return ends


def tokens_needed(batch: Sequence[Request], kind: int, budget: int = 0) -> int:
    """New KV slots the batch's next forward takes (its chunks under a budget)."""
    ends = chunk_ends(batch, kind, budget)
    return sum(e - r.kv[kind].length for r, e in zip(batch, ends, strict=True))


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
    # Per request: its chunk stops short of its last pending token (chunked prefill): the
    # chunk's KV is committed, nothing is sampled, routed or delivered for it this step.
    incomplete: np.ndarray
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

    def complete(self, out: ForwardOutput) -> tuple[list[Request], ForwardOutput]:
        """The requests whose last chunk ran (every request, unless a chunk stopped short)
        and their rows of the output: what is sampled and routed."""
        if not self.incomplete.any():
            return self.batch, out
        rows = np.flatnonzero(~self.incomplete)
        idx = torch.from_numpy(rows).to(out.logits.device)
        sel = ForwardOutput(logits=out.logits[idx], hidden=out.hidden[idx.to(out.hidden.device)])
        return [self.batch[i] for i in rows], sel

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


def prepare_forward(
    side: ModelSide, batch: Sequence[Request], kind: int, chunk: Sequence[int] | None = None
) -> PreparedForward:
    """A forward over every request's tokens not yet in this model's KV (room already made),
    or, chunked, over r.seq[length:end] for chunk's end per request (chunk_ends; each end past
    its request's length). O(batch + new tokens): the new slots are appended to the requests'
    slot-table rows, which the runner reads in place; nothing is copied per context token."""
    n = len(batch)
    handles = [r.kv[kind] for r in batch]
    starts = np.fromiter((h.length for h in handles), np.int64, n)
    full = np.fromiter((r.n for r in batch), np.int64, n)
    ends = full if chunk is None else np.asarray(chunk, dtype=np.int64)
    rows = np.fromiter((h.row for h in handles), np.int64, n)
    q_lens = ends - starts
    q_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=q_off[1:])
    total = int(q_off[-1])
    if total == n:  # decode: each request's one token at its last position
        tokens = np.fromiter(
            (r.seq[e - 1] for r, e in zip(batch, ends.tolist(), strict=True)), np.int64, n
        )
        positions, token_rows = starts, rows
    else:
        tokens = np.concatenate([r.seq[s:e] for r, s, e in zip(batch, starts, ends, strict=True)])
        positions = np.repeat(starts - q_off[:-1], q_lens) + np.arange(total, dtype=np.int64)
        token_rows = np.repeat(rows, q_lens)
    new_slots = side.alloc(total)
    side.table.scatter(token_rows, positions, new_slots)
    host = HostBatch.from_table(side.table, rows, tokens, positions, new_slots, q_off, ends)
    return PreparedForward(
        side, list(batch), handles, q_off, ends, tokens, new_slots, host, ends < full
    )
