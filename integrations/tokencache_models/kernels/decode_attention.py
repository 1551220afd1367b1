"""Triton paged-attention decode kernel (one new token per request, split over the KV length).

Each program handles one (request, kv_head, split): it loads the GQA group's queries once, walks
its share of the request's slot list in BLOCK_N chunks (gathering K/V rows by slot id) with an
online softmax, and writes a partial (acc, max, sum). One merge launch combines the splits,
so a batch of one still spreads a long context over many SMs (flash-decoding).

Importing this module needs triton; it is imported lazily and only on CUDA (or under
TRITON_INTERPRET=1 for CPU testing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..forward.context import SharedPrefix
from .shared_prefix_attention import prefix_splits, shared_prefix_partials
from .split_kv import (
    attend_block,
    cache_strides,
    kv_block,
    merge_splits,
    partial_strides,
    store_empty_partials,
)


@triton.jit  # type: ignore[untyped-decorator]
def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Slots,
    KvStart,
    KvLen,
    Skip,
    Acc,
    M,
    L,
    sm_scale,
    num_splits,
    prefix_cols,  # split columns after this kernel's own that the prefix kernel fills
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ab,
    stride_ah,
    stride_as,
    stride_mb,
    stride_mh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    SKIP: tl.constexpr,  # each row's first Skip[b] slots are its group's prefix, read elsewhere
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(KvStart + b)
    end = start + tl.load(KvLen + b)
    if SKIP:
        # A row keeps at least its own new token's slot.
        row_skip = tl.load(Skip + b)
        start += tl.minimum(row_skip, end - start - 1)
    per_split = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, end)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g

    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + offs_n
        n_mask = idx < hi
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, K, V, Slots, idx, n_mask, n_mask[None, :], kvh, offs_d, d_mask,
            sm_scale, stride_ks, stride_kh, stride_vs, stride_vh, IEEE,
        )  # fmt: skip

    out_mask = g_mask[:, None] & d_mask[None, :]
    tl.store(
        Acc + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_d[None, :],
        acc,
        mask=out_mask,
    )
    tl.store(M + b * stride_mb + heads * stride_mh + split, m_i, mask=g_mask)
    tl.store(L + b * stride_mb + heads * stride_mh + split, l_i, mask=g_mask)
    if SKIP:  # noqa: SIM102 (row_skip exists in SKIP kernels only: a constexpr branch)
        # A row outside every group (padding rows too): no prefix tile covers it, so its prefix
        # columns are written empty here (m = -inf, l = 0, acc = 0) for the merge.
        if (row_skip == 0) & (split == 0):
            store_empty_partials(
                Acc, M, L, b + 0 * offs_g, heads, num_splits, prefix_cols, g_mask, offs_d,
                d_mask, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, GROUP_PAD, BLOCK_D,
            )  # fmt: skip


def num_splits(batch: int, kv_heads: int) -> int:
    """Enough programs to fill ~2 waves of a large GPU. A function of the grid only, never of the
    context length: a CUDA graph fixes it at capture, and eager and graph decode of the same
    bucket then merge the same splits in the same order (bit-identical results). Splits past a
    short context are empty and exit after one length check."""
    target = 264
    return int(max(1, min(-(-target // (batch * kv_heads)), 32)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    prefix: SharedPrefix | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k_cache/v_cache: [slots, KVH, D] (last dim contiguous); row b's slots are
    kv_slots[kv_starts[b] : kv_starts[b] + kv_lens[b]] (a flat slot list or the slot table;
    int32 or int64, on q's device); block_n: None for kv_block's
    choice; prefix: None, or the forward's shared-prefix tables (HostBatch.prefix_groups): each
    group's prefix is read once for its rows by the shared-prefix kernel and skipped here.
    Returns [B, H, D] in q's dtype.
    Launch parameters come from shapes only: no host sync, graph-capturable."""
    bsz, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    splits = num_splits(bsz, kv_heads)
    # The prefix kernel's splits from the grid only (a graph replays them for any P).
    extra = 0 if prefix is None else prefix_splits(q, k_cache)
    total = splits + extra
    acc = torch.empty((bsz, heads, total, head_dim), device=q.device, dtype=torch.float32)
    m = torch.empty((bsz, heads, total), device=q.device, dtype=torch.float32)
    lse = torch.empty_like(m)
    grid = (bsz, kv_heads, splits)
    _paged_decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        kv_slots,
        kv_starts,
        kv_lens,
        kv_lens if prefix is None else prefix.row_skip,
        acc,
        m,
        lse,
        scale,
        splits,
        extra,
        q.stride(0),
        q.stride(1),
        *cache_strides(k_cache, v_cache),
        *partial_strides(acc, m),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n or kv_block(k_cache.dtype),
        IEEE=k_cache.dtype == torch.float32,
        SKIP=prefix is not None,
    )
    if prefix is not None:
        shared_prefix_partials(q, k_cache, v_cache, kv_slots, prefix, acc, m, lse, splits, scale)
    out = torch.empty_like(q)
    merge_splits(acc, m, lse, out)
    return out
