"""A routed request and the batched forward over a model side (shared by both run modes)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from tokencache_models import ForwardBatch, ForwardOutput

from .kv import CursorKV, ModelSide
from .naive import NaiveKV
from .routers import Router, RouterFeatures

KVHandle = CursorKV | NaiveKV


class Request:
    def __init__(self, rid: int, prompt: Sequence[int], max_new_tokens: int) -> None:
        if len(prompt) == 0:
            raise ValueError("prompts must not be empty")
        self.rid = rid
        self.prompt_len = len(prompt)
        self.seq = np.empty(len(prompt) + max_new_tokens, dtype=np.int64)
        self.seq[: len(prompt)] = np.asarray(prompt, dtype=np.int64)
        self.n = len(prompt)
        self.models: list[int] = []
        self.kv: list[KVHandle] = []
        self.parked_at: float = 0
        self.admit_order = 0
        self.held_catchup = False  # held out of a catch-up batch once: goes in the next one
        self.aborted = False  # RoutedEngine.abort: dropped by whoever holds it next

    @property
    def num_generated(self) -> int:
        return self.n - self.prompt_len


def overlaps_prefill(r: Request, running: Sequence[Request], kind: int, page_size: int) -> bool:
    """True when r shares at least a page of prefix with a request whose prefill in this model
    has not run yet: admitted together, both would prefill it (the duplicate freed afterwards),
    so r waits one step and then matches the first one's KV in the tree instead."""
    for q in running:
        if q.kv[kind].attached:
            continue
        m = min(r.n, q.n) - 1  # attach matches seq[:-1]
        if m < page_size:
            continue
        diff = np.flatnonzero(r.seq[:m] != q.seq[:m])
        if (diff[0] if len(diff) else m) >= page_size:
            return True
    return False


def take_catchup_batch(
    parked: Sequence[Request], cap: int, kind: int, page_size: int
) -> tuple[list[Request], list[Request], list[Request]]:
    """Splits parked requests into (catch-up batch, left parked, held back). A request
    making its first forward in this model (handle not attached) that shares at least a page of
    prefix with another one being attached in this batch is held for the next batch, where it
    matches the first one's KV in the tree instead of prefilling the prefix again. A request
    held once is never held again (no starvation); parked order is kept."""
    batch: list[Request] = []
    rest: list[Request] = []
    held: list[Request] = []
    for r in parked:
        if len(batch) >= cap:
            rest.append(r)
        elif (
            r.held_catchup or r.kv[kind].attached or not overlaps_prefill(r, batch, kind, page_size)
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


def run_forward(
    side: ModelSide, batch: Sequence[Request], kind: int
) -> tuple[ForwardOutput, float, int]:
    """One forward over every request's tokens not yet in this model's KV (room already made);
    returns (output, forward seconds, tokens computed). Handles are extended in one call."""
    handles = [r.kv[kind] for r in batch]
    starts = np.fromiter((h.length for h in handles), np.int64, len(batch))
    ends = np.fromiter((r.n for r in batch), np.int64, len(batch))
    q_lens = ends - starts
    q_off = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=q_off[1:])
    tokens = np.concatenate([r.seq[s:e] for r, s, e in zip(batch, starts, ends, strict=True)])
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    new_slots = side.pool.alloc(int(q_off[-1])).numpy()
    parts: list[np.ndarray] = []
    for i, h in enumerate(handles):  # each request: its kept slot row, then its new slots
        parts += (h.slots(), new_slots[q_off[i] : q_off[i + 1]])
    kv = np.concatenate(parts)
    kv_off = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(ends, out=kv_off[1:])
    fb = ForwardBatch(
        token_ids=torch.from_numpy(tokens),
        positions=torch.from_numpy(positions),
        out_slots=torch.from_numpy(new_slots),
        q_offsets=torch.from_numpy(q_off),
        kv_slots=torch.from_numpy(kv),
        kv_offsets=torch.from_numpy(kv_off),
    )
    t0 = time.perf_counter()
    out = side.model(fb, side.pool)
    dt = time.perf_counter() - t0
    type(handles[0]).commit_many(side, handles, q_off, tokens, new_slots)  # type: ignore[arg-type]
    return out, dt, int(q_off[-1])


def route_step(
    router: Router, out: ForwardOutput, batch: Sequence[Request]
) -> tuple[torch.Tensor, list[bool]]:
    """One small-model step's greedy tokens and the router's escalate answers."""
    tok = out.logits.argmax(-1)
    feats = RouterFeatures(
        logits=out.logits,
        hidden=out.hidden,
        tokens=tok,
        positions=torch.tensor([r.num_generated for r in batch], dtype=torch.int64),
        rids=torch.tensor([r.rid for r in batch], dtype=torch.int64),
    )
    return tok, router.route(feats).tolist()
