"""Paged attention over KV-pool slots: a portable torch path and a Triton GPU decode path."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .batch import ForwardBatch


@dataclass
class AttentionMetadata:
    """Per-forward indexing, built once and reused by every layer."""

    q_offsets: list[int]
    kv_offsets: list[int]
    decode_only: bool  # every request has exactly one new token
    kv_slots: torch.Tensor  # [S] on the model device
    # Decode-only padded layout for the batched torch path: [B, Lmax] slot ids and validity.
    padded_slots: torch.Tensor | None = None
    padded_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] bool
    # Triton decode path: kv offsets on the device.
    kv_offsets_dev: torch.Tensor | None = None
    max_kv_len: int = 0
    use_triton: bool = False


class TorchPagedAttention:
    """Portable path: gather K/V by slot and call scaled_dot_product_attention (CPU and GPU)."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, device: torch.device) -> AttentionMetadata:
        q_off = batch.q_offsets.tolist()
        kv_off = batch.kv_offsets.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(q_off)]
        meta = AttentionMetadata(
            q_offsets=q_off,
            kv_offsets=kv_off,
            decode_only=all(n == 1 for n in q_lens),
            kv_slots=batch.kv_slots.to(device),
        )
        if meta.decode_only:
            kv_lens = torch.tensor([b - a for a, b in itertools.pairwise(kv_off)], device=device)
            lmax = int(max(b - a for a, b in itertools.pairwise(kv_off)))
            cols = torch.arange(lmax, device=device)
            valid = cols[None, :] < kv_lens[:, None]
            starts = torch.tensor(kv_off[:-1], device=device)
            idx = (starts[:, None] + cols[None, :]).clamp_max(meta.kv_slots.numel() - 1)
            # Padding columns read slot 0 and are masked out.
            meta.padded_slots = torch.where(valid, meta.kv_slots[idx], 0)
            meta.padded_mask = valid[:, None, None, :]
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D]; k_cache/v_cache: one pool layer, [slots, KVH, D]. Returns [T, H, D]."""
        if meta.decode_only:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        q_off, kv_off = meta.q_offsets, meta.kv_offsets
        for i in range(len(q_off) - 1):
            q0, q1, kv0, kv1 = q_off[i], q_off[i + 1], kv_off[i], kv_off[i + 1]
            n, length = q1 - q0, kv1 - kv0
            slots = meta.kv_slots[kv0:kv1]
            qi = q[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            vi = v_cache[slots].transpose(0, 1).unsqueeze(0)
            mask = None
            if n > 1:
                # Bottom-right causal: new token j sits at slot-list index length - n + j.
                rows = torch.arange(length - n, length, device=q.device)
                mask = torch.arange(length, device=q.device)[None, :] <= rows[:, None]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[q0:q1] = oi[0].transpose(0, 1)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # One batched SDPA over a padded [B, Lmax] gather: no Python loop for decode steps.
        assert meta.padded_slots is not None and meta.padded_mask is not None
        k = k_cache[meta.padded_slots].transpose(1, 2)  # [B, KVH, Lmax, D]
        v = v_cache[meta.padded_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=meta.padded_mask, scale=scale, enable_gqa=True
        )
        return o.squeeze(2)


class TritonPagedAttention(TorchPagedAttention):
    """GPU path: Triton split-KV paged decode kernel; mixed/prefill batches use the torch path."""

    name = "triton"

    def prepare(self, batch: ForwardBatch, device: torch.device) -> AttentionMetadata:
        q_lens = batch.q_offsets.diff()
        if not bool((q_lens == 1).all()):
            return super().prepare(batch, device)
        meta = AttentionMetadata(
            q_offsets=[],
            kv_offsets=[],
            decode_only=True,
            kv_slots=batch.kv_slots.to(device),
            kv_offsets_dev=batch.kv_offsets.to(device=device, dtype=torch.int32),
            max_kv_len=int(batch.kv_offsets.diff().max()),
            use_triton=True,
        )
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not meta.use_triton:
            return super().forward(q, k_cache, v_cache, meta, scale)
        # Deferred import: CPU-only users never load triton.
        from .triton_decode import paged_decode

        assert meta.kv_offsets_dev is not None
        return paged_decode(
            q, k_cache, v_cache, meta.kv_slots, meta.kv_offsets_dev, scale, meta.max_kv_len
        )


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def make_attention_backend(name: str, device: torch.device | str) -> TorchPagedAttention:
    """name: "auto" (Triton on CUDA when importable, else torch), "torch" or "triton"."""
    device = torch.device(device)
    if name == "torch":
        return TorchPagedAttention()
    if name == "triton":
        if not triton_available():
            raise RuntimeError("attention backend 'triton' requested but triton is not importable")
        return TritonPagedAttention()
    if name == "auto":
        if device.type == "cuda" and triton_available():
            return TritonPagedAttention()
        return TorchPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}")
