"""A ragged forward batch: flat per-token tensors plus per-request offsets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _i64(x: torch.Tensor | Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64).reshape(-1)


@dataclass
class ForwardBatch:
    """Inputs of one forward call over B requests with T new tokens in total.

    Request i owns new tokens token_ids[q_offsets[i]:q_offsets[i+1]] at the given positions;
    their K/V are written into out_slots (same range). It attends over the slot list
    kv_slots[kv_offsets[i]:kv_offsets[i+1]]: its prefix slots (possibly shared with other
    requests, only read) followed by exactly its new out_slots, so causality inside the new tokens
    follows slot-list order.
    """

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    q_offsets: torch.Tensor  # [B + 1] int64, CPU
    kv_slots: torch.Tensor  # [S] int64
    kv_offsets: torch.Tensor  # [B + 1] int64, CPU

    @property
    def num_requests(self) -> int:
        return self.q_offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def kv_starts(self) -> torch.Tensor:
        """[B] where each request's slot list starts in kv_slots (the kernels' row starts)."""
        return self.kv_offsets[:-1]

    @property
    def kv_lens(self) -> torch.Tensor:
        """[B] each request's slot-list length."""
        return self.kv_offsets.diff()

    @classmethod
    def from_requests(
        cls,
        new_token_ids: Sequence[torch.Tensor | Sequence[int]],
        prefix_slots: Sequence[torch.Tensor | Sequence[int]],
        new_slots: Sequence[torch.Tensor | Sequence[int]],
        positions: Sequence[torch.Tensor | Sequence[int]] | None = None,
    ) -> ForwardBatch:
        """Convenience builder; positions default to len(prefix) + arange(len(new))."""
        toks = [_i64(t) for t in new_token_ids]
        pre = [_i64(s) for s in prefix_slots]
        new = [_i64(s) for s in new_slots]
        if not (len(toks) == len(pre) == len(new)):
            raise ValueError("new_token_ids, prefix_slots and new_slots must have equal length")
        pre_lens = [p.numel() for p in pre]
        q_list = [t.numel() for t in toks]
        if positions is None:
            pos = [torch.arange(a, a + n) for a, n in zip(pre_lens, q_list, strict=True)]
        else:
            pos = [_i64(p) for p in positions]
        q_lens = torch.tensor([0, *q_list], dtype=torch.int64)
        kv_lens = torch.tensor([0] + [a + n for a, n in zip(pre_lens, q_list, strict=True)])
        batch = cls(
            token_ids=torch.cat(toks),
            positions=torch.cat(pos),
            out_slots=torch.cat(new),
            q_offsets=q_lens.cumsum(0),
            kv_slots=torch.cat([torch.cat((p, n)) for p, n in zip(pre, new, strict=True)]),
            kv_offsets=kv_lens.cumsum(0),
        )
        batch.validate()
        return batch

    def validate(self) -> None:
        """Checks the layout contract (O(T + S) work; call it off the hot path)."""
        t = self.token_ids.numel()
        if not (self.positions.numel() == self.out_slots.numel() == t):
            raise ValueError("token_ids, positions and out_slots must have the same length")
        if self.q_offsets.numel() != self.kv_offsets.numel() or self.num_requests < 1:
            raise ValueError("q_offsets and kv_offsets must both have B + 1 >= 2 entries")
        if int(self.q_offsets[-1]) != t or int(self.kv_offsets[-1]) != self.kv_slots.numel():
            raise ValueError("offsets do not cover the flat tensors")
        q_lens = self.q_offsets.diff()
        kv_lens = self.kv_offsets.diff()
        if bool((q_lens < 1).any()) or bool((kv_lens < q_lens).any()):
            raise ValueError("every request needs >= 1 new token and kv_len >= q_len")
        kv_cpu, out_cpu = self.kv_slots.cpu(), self.out_slots.cpu()
        for i in range(self.num_requests):
            q0, q1 = int(self.q_offsets[i]), int(self.q_offsets[i + 1])
            kv1 = int(self.kv_offsets[i + 1])
            if not torch.equal(kv_cpu[kv1 - (q1 - q0) : kv1], out_cpu[q0:q1]):
                raise ValueError(f"request {i}: kv slot list must end with its out_slots")

    def to(self, device: torch.device | str) -> ForwardBatch:
        """Moves the flat tensors; offsets stay on the CPU (read as ints once per forward)."""
        return ForwardBatch(
            token_ids=self.token_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            out_slots=self.out_slots.to(device, non_blocking=True),
            q_offsets=self.q_offsets.cpu(),
            kv_slots=self.kv_slots.to(device, non_blocking=True),
            kv_offsets=self.kv_offsets.cpu(),
        )
