"""Paged attention over KV-pool slots: a portable torch path and Triton GPU kernels.

A backend is built once per model. Per forward it gets two calls before the layers run:
plan(host_batch) (a HostPlan: host-side tables from numpy, only for what cannot be built on the
device without reading it back; its arrays travel in the context's one copy) and prepare(ctx)
(AttnTables: device-side tables, launched without any host sync). Every layer then calls
forward(q, k_cache, v_cache, ctx, attn, scale). Neither the context nor the tables change
once built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from .forward.context import ForwardContext, HostBatch, HostPlan

# A torch multi-token group is padded to [n, Qmax, Lmax]; a request joins the current group
# while the padded work stays within this factor of the real work (plus a small constant).
GROUP_WASTE = 2.0
GROUP_SLACK = 64 * 64


def plan_groups(q_lens: np.ndarray, kv_lens: np.ndarray) -> list[np.ndarray]:
    """Splits requests into groups whose padded [n, Qmax, Lmax] attention wastes little work.

    Requests are taken by decreasing (q_len, kv_len); usually one group (catch-ups of similar
    requests), several only for skewed batches (one long prefill among decodes)."""
    order = np.lexsort((-kv_lens, -q_lens))
    groups: list[list[int]] = []
    qm = lm = real = 0
    for i in order.tolist():
        q, kv = int(q_lens[i]), int(kv_lens[i])
        if groups:
            n = len(groups[-1]) + 1
            nq, nl = max(qm, q), max(lm, kv)
            if n * nq * nl <= GROUP_WASTE * (real + q * kv) + GROUP_SLACK:
                groups[-1].append(i)
                qm, lm, real = nq, nl, real + q * kv
                continue
        groups.append([i])
        qm, lm, real = q, kv, q * kv
    return [np.asarray(g, dtype=np.int64) for g in groups]


@dataclass(frozen=True)
class TokenGroup:
    """One padded [n, Qmax, Lmax] group of a multi-token batch on the torch path."""

    q_idx: torch.Tensor  # [n * Qmax] flat query token of each padded query row
    slots: torch.Tensor  # [n, Lmax] slot ids (the scratch slot past each row's length)
    mask: torch.Tensor  # [n, 1, Qmax, Lmax] bottom-right causal and valid
    q_max: int


@dataclass(frozen=True)
class AttnTables:
    """A backend's per-forward device tables (prepare), read by every layer. The torch path:
    decode batches one [B, W] slot gather and its mask; multi-token batches one TokenGroup per
    padded group and each token's row in their concatenated outputs. The Triton kernels read
    the context itself: empty."""

    slots: torch.Tensor | None = None  # decode: [B, W]
    mask: torch.Tensor | None = None  # decode: [B, 1, 1, W]
    groups: tuple[TokenGroup, ...] = ()
    rows: torch.Tensor | None = None  # [T] row of token t in the groups' outputs


def _padded_slots(
    ctx: ForwardContext, starts: torch.Tensor, lens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, width] slot ids (kv_slots[start + col], the scratch slot past each length) and the
    validity mask; device ops only, fixed shapes."""
    cols = torch.arange(width, device=ctx.device)
    valid = cols[None, :] < lens[:, None]
    idx = (starts[:, None] + cols[None, :]).clamp_max(ctx.kv_slots.numel() - 1)
    return torch.where(valid, ctx.kv_slots[idx], ctx.scratch_slot), valid


class TorchPagedAttention:
    """Portable path: gather K/V by slot into padded blocks and call SDPA (CPU and GPU).

    Decode rows: one [B, W] gather (W = ctx.kv_width) and one SDPA. Multi-token batches: one
    padded gather + bottom-right causal mask per group of similar requests (usually one group);
    no Python loop over requests.
    """

    name = "torch"
    shares_prefix = False  # the reference path: every row reads its whole slot list

    def plan(self, hb: HostBatch) -> HostPlan:
        q_lens, kv_lens = hb.q_lens, hb.kv_lens
        if bool((q_lens == 1).all()):
            return HostPlan()
        groups = plan_groups(q_lens, kv_lens)
        dims: list[tuple[int, int, int]] = []
        arrays: list[np.ndarray] = []
        q_off = hb.q_offsets
        first_row = np.empty(len(q_lens), dtype=np.int64)  # padded output row of token 0
        base = 0
        for g in groups:
            qm, lm = int(q_lens[g].max()), int(kv_lens[g].max())
            j = np.arange(qm, dtype=np.int64)
            # Padded query rows re-read the request's last token (computed, then dropped).
            q_idx = q_off[g][:, None] + np.minimum(j[None, :], q_lens[g][:, None] - 1)
            first_row[g] = base + np.arange(len(g), dtype=np.int64) * qm
            base += len(g) * qm
            dims.append((len(g), qm, lm))
            arrays += [g, q_idx.reshape(-1)]
        req_of_token = np.repeat(np.arange(len(q_lens), dtype=np.int64), q_lens)
        within = np.arange(int(q_off[-1]), dtype=np.int64) - q_off[req_of_token]
        arrays.append(first_row[req_of_token] + within)
        return HostPlan(tuple(dims), tuple(arrays))

    def prepare(self, ctx: ForwardContext) -> AttnTables:
        kv_starts, kv_lens = ctx.kv_starts, ctx.kv_lens
        if ctx.is_decode:
            slots, valid = _padded_slots(ctx, kv_starts, kv_lens, ctx.kv_width)
            return AttnTables(slots=slots, mask=valid[:, None, None, :])
        if ctx.q_width:
            return self._static_tables(ctx)
        q_lens = ctx.q_offsets.diff()
        arrays = ctx.plan_arrays
        groups = []
        for gi, (_, qm, lm) in enumerate(ctx.plan_groups):
            req, q_idx = arrays[2 * gi], arrays[2 * gi + 1]
            lens, qn = kv_lens[req], q_lens[req]
            slots, valid = _padded_slots(ctx, kv_starts[req], lens, lm)
            # Bottom-right causal: new token j sits at slot-list index kv_len - q_len + j.
            rows = torch.arange(qm, device=ctx.device)
            cols = torch.arange(lm, device=ctx.device)
            limit = (lens - qn)[:, None, None] + rows[None, :, None]
            mask = valid[:, None, :] & (cols[None, None, :] <= limit)
            groups.append(TokenGroup(q_idx, slots, mask[:, None], qm))
        return AttnTables(groups=tuple(groups), rows=arrays[-1])

    @staticmethod
    def _static_tables(ctx: ForwardContext) -> AttnTables:
        """A multi-token batch in a graph's static layout (ctx.q_width): one padded
        [rows, q_width, kv_width] group built on the device from the context's buffers, the
        same shapes whatever the rows hold (no host plan, so it can be captured)."""
        qm, lm, device = ctx.q_width, ctx.kv_width, ctx.device
        q_off, kv_lens = ctx.q_offsets, ctx.kv_lens
        q_lens = q_off.diff()
        j = torch.arange(qm, device=device)
        # Padded query rows re-read the row's last token (an empty row, any token: dropped).
        within = torch.minimum(j[None, :], (q_lens - 1).clamp_min(0)[:, None])
        q_idx = (q_off[:-1, None] + within).clamp_max(ctx.num_tokens - 1).reshape(-1)
        slots, valid = _padded_slots(ctx, ctx.kv_starts, kv_lens, lm)
        cols = torch.arange(lm, device=device)
        limit = (kv_lens - q_lens)[:, None, None] + j[None, :, None]
        mask = valid[:, None, :] & (cols[None, None, :] <= limit)
        group = TokenGroup(q_idx, slots, mask[:, None], qm)
        tokens = torch.arange(ctx.num_tokens, device=device)
        row = torch.searchsorted(q_off[1:], tokens, right=True)
        return AttnTables(groups=(group,), rows=row * qm + tokens - q_off[row])

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: ForwardContext,
        attn: AttnTables,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D]; k_cache/v_cache: one pool layer, [slots, KVH, D]; attn: this
        forward's prepare(ctx). Returns [T, H, D]."""
        if ctx.is_decode:
            assert attn.slots is not None and attn.mask is not None
            return self._sdpa(q[:, None], k_cache, v_cache, attn.slots, attn.mask, scale)[:, 0]
        assert attn.rows is not None
        outs = []
        for g in attn.groups:
            qg = q.index_select(0, g.q_idx).view(-1, g.q_max, q.shape[1], q.shape[2])
            outs.append(self._sdpa(qg, k_cache, v_cache, g.slots, g.mask, scale).flatten(0, 1))
        flat = outs[0] if len(outs) == 1 else torch.cat(outs)
        return flat.index_select(0, attn.rows)

    @staticmethod
    def _sdpa(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [n, Q, H, D]; slots/mask: [n, L] / [n, 1, Q, L]. Returns [n, Q, H, D]."""
        k = k_cache[slots].transpose(1, 2)  # [n, KVH, L, D]
        v = v_cache[slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return o.transpose(1, 2)


class TritonPagedAttention(TorchPagedAttention):
    """GPU path: a split-KV paged decode kernel for decode rows and a paged varlen
    (flash-attention style) kernel for prefill / extend / mixed batches; one launch per layer
    either way, shapes from host-known maxima only. shared_prefix (default on): when groups of
    rows start with the same slots (ForwardContext.prefix), a third kernel reads each group's
    prefix once and the per-row kernels skip it (kernels/shared_prefix_attention.py)."""

    name = "triton"

    def __init__(self, shared_prefix: bool = True) -> None:
        self.shares_prefix = shared_prefix

    def plan(self, hb: HostBatch) -> HostPlan:
        return HostPlan()

    def prepare(self, ctx: ForwardContext) -> AttnTables:
        return AttnTables()

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: ForwardContext,
        attn: AttnTables,
        scale: float,
    ) -> torch.Tensor:
        # Deferred imports: CPU-only users never load triton.
        if ctx.is_decode:
            from .kernels.decode_attention import paged_decode

            return paged_decode(
                q, k_cache, v_cache, ctx.kv_slots, ctx.kv_starts, ctx.kv_lens, scale,
                prefix=ctx.prefix,
            )  # fmt: skip
        from .kernels.varlen_attention import paged_varlen

        return paged_varlen(
            q, k_cache, v_cache, ctx.kv_slots, ctx.q_offsets, ctx.kv_starts, ctx.kv_lens, scale,
            ctx.max_q_len, kv_total=ctx.kv_total, splits=ctx.splits, prefix=ctx.prefix,
        )  # fmt: skip


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
