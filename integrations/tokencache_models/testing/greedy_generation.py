"""A minimal greedy runner over CausalLM + KVPool: request bookkeeping for tests and examples.

Requests keep their KV as a slot list; a request may start from another one's prefix slots
(shared, refcounted, never recomputed). Not a scheduler: the caller picks which requests step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..forward.forward_batch import ForwardBatch
from ..kv.pool import KVPool
from ..model import CausalLM, ForwardOutput


@dataclass
class GreedyRequest:
    """One GreedyRunner request (not the routing engine's state.Request)."""

    tokens: list[int]  # every token whose K/V is in `slots`, then the pending ones
    slots: torch.Tensor  # int64, K/V of tokens[:len(slots)]
    pending: list[int] = field(default_factory=list)  # tokens not yet run through the model
    generated: list[int] = field(default_factory=list)


class GreedyRunner:
    def __init__(self, model: CausalLM, pool: KVPool, attention_backend: str | None = None) -> None:
        self.model = model
        self.pool = pool
        self.attention_backend = attention_backend
        self.requests: dict[int, GreedyRequest] = {}
        self._refs = torch.zeros(pool.num_slots, dtype=torch.int32)
        self._next_id = 0

    def add_request(
        self, prompt: Sequence[int], share_from: int | None = None, shared_len: int = 0
    ) -> int:
        """New request; with share_from, its first shared_len tokens reuse that request's slots."""
        prompt = list(prompt)
        slots = torch.empty(0, dtype=torch.int64)
        if share_from is not None and shared_len > 0:
            src = self.requests[share_from]
            if shared_len > src.slots.numel() or src.tokens[:shared_len] != prompt[:shared_len]:
                raise ValueError(
                    "shared prefix must be computed in the source and match the prompt"
                )
            if shared_len >= len(prompt):
                raise ValueError("at least one prompt token must remain to be run")
            slots = src.slots[:shared_len].clone()
            self._refs[slots] += 1
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = GreedyRequest(
            tokens=prompt, slots=slots, pending=prompt[slots.numel() :]
        )
        return rid

    def step(self, rids: Sequence[int]) -> ForwardOutput:
        """Runs every pending token of the given requests in one forward; appends greedy tokens."""
        reqs = [self.requests[r] for r in rids]
        new_slots = [self.pool.alloc(len(r.pending)) for r in reqs]
        for s in new_slots:
            self._refs[s] += 1
        batch = ForwardBatch.from_requests(
            [r.pending for r in reqs], [r.slots for r in reqs], new_slots
        )
        out = self.model.forward(batch, self.pool, self.attention_backend)
        next_ids = out.logits.argmax(dim=-1).tolist()
        for r, s, nxt in zip(reqs, new_slots, next_ids, strict=True):
            r.slots = torch.cat((r.slots, s))
            r.pending = [nxt]
            r.tokens.append(nxt)
            r.generated.append(nxt)
        return out

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        """Replaces the pending token with caller-chosen ones (e.g. a large model's tokens)."""
        r = self.requests[rid]
        if r.pending and r.generated and r.pending == [r.generated[-1]]:
            r.tokens.pop()
            r.generated.pop()
            r.pending = []
        r.pending.extend(tokens)
        r.tokens.extend(tokens)

    def generate(self, rids: Sequence[int], max_new_tokens: int) -> list[list[int]]:
        for _ in range(max_new_tokens):
            self.step(rids)
        return [self.requests[r].generated[-max_new_tokens:] for r in rids]

    def release(self, rid: int) -> None:
        r = self.requests.pop(rid)
        self._refs[r.slots] -= 1
        dead = r.slots[self._refs[r.slots] == 0]
        self.pool.free(dead)
