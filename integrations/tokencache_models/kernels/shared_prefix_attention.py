"""Triton shared-prefix attention: each group's common slot-list prefix read once for its rows.

When rows of a forward start with the same P slots (a system prompt: the radix tree hands all
of its requests the same KV slots), reading those slots once per row wastes (rows - 1) x P slot
reads per layer: at 32 rows x 8k that is nearly all of a decode step's memory traffic. Rows fall
into groups with a prefix each (shared_prefix/groups.py). Program (tile, split, kvh) takes one tile
of the tile table (up to PrefixShape.tokens_per_block query tokens of one group, with the kv head's
whole GQA group), walks its split of the group's prefix slots (the anchor row's) without a mask
(every new token comes after the prefix) and writes partial (acc, max, sum) triples into extra split
columns of the caller's partial buffers (empty tiles, which pad a graph's table, write nothing). The
decode and varlen kernels then skip each row's prefix (their SKIP mode; rows outside every group
write their prefix columns empty) and one merge combines both (cascade attention, as FlashInfer's
and Hydragen's). The tables live on the device, so a CUDA graph captured for a group count serves
any grouping and prefix lengths. The tile, passes and splits come from shared_prefix/shape.py, which
the runner and the routing engine's clock read too.

Imported lazily, on CUDA or under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..forward.context import SharedPrefix
from ..shared_prefix.groups import TILE_FIELDS
from ..shared_prefix.shape import PrefixShape
from .split_kv import (
    attend_block,
    cache_strides,
    load_query_tokens,
    partial_strides,
    store_partial,
)


@triton.jit  # type: ignore[untyped-decorator]
def _shared_prefix_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Slots,
    Tiles,
    Tokens,
    Acc,
    M,
    L,
    sm_scale,
    splits,
    split0,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_at,
    stride_ah,
    stride_as,
    stride_mt,
    stride_mh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    FIELDS: tl.constexpr,  # tile-table columns (shared_prefix.groups.TILE_FIELDS)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = Tiles + tl.program_id(0) * FIELDS
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    t0 = tl.load(tile)
    count = tl.load(tile + 1)
    base = tl.load(tile + 2)  # the anchor row's slot list starts with the prefix
    plen = tl.load(tile + 3)  # an empty tile (count 0) stores nothing
    per_split = tl.cdiv(tl.cdiv(plen, splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, plen)

    q, tok, head, row_ok, offs_d, d_mask = load_query_tokens(
        Q, Tokens, t0, count, kvh, stride_qt, stride_qh, ROWS, GROUP, GROUP_PAD, HEAD_DIM,
        BLOCK_D,
    )  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols < hi
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, K, V, Slots + base, cols, n_mask, n_mask[None, :], kvh, offs_d,
            d_mask, sm_scale, stride_ks, stride_kh, stride_vs, stride_vh, IEEE,
        )  # fmt: skip
    store_partial(
        Acc, M, L, acc, m_i, l_i, tok, head, split0 + split, row_ok, offs_d, d_mask, stride_at,
        stride_ah, stride_as, stride_mt, stride_mh,
    )  # fmt: skip


def prefix_shape(q: torch.Tensor, k_cache: torch.Tensor) -> PrefixShape:
    """The kernel's shape for queries q [T, H, D] over a cache [slots, KVH, D]."""
    kv_heads = k_cache.shape[1]
    return PrefixShape(q.shape[1] // kv_heads, kv_heads, q.shape[2], k_cache.dtype.itemsize)


def prefix_splits(q: torch.Tensor, k_cache: torch.Tensor, prefix_len: int | None = None) -> int:
    """Split columns the prefix kernel fills for the query tokens q (PrefixShape.splits)."""
    return prefix_shape(q, k_cache).splits(q.shape[0], prefix_len)


def shared_prefix_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix: SharedPrefix,
    acc: torch.Tensor,
    m: torch.Tensor,
    lse: torch.Tensor,
    split0: int,
    scale: float,
) -> None:
    """Attention of the query rows q [T, H, D] over their groups' prefixes (prefix.tiles: each
    tile's tokens over the first P entries of its anchor's slot list in kv_slots), unmasked,
    written as partials into split columns [split0, acc.shape[2]) of acc [T, H, S, D] and m /
    lse [T, H, S] (fp32, contiguous) for the groups' tokens; the caller's own kernels fill
    columns [0, split0), and those of rows outside every group, and merge_splits combines all.
    Launch parameters come from shapes only: no host sync, graph-capturable."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    shape = prefix_shape(q, k_cache)
    splits = acc.shape[2] - split0
    assert splits >= 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if prefix.tokens_per_tile > shape.tokens_per_block:  # a tile's extra tokens would be lost
        raise ValueError(
            f"prefix tables cut for {prefix.tokens_per_tile} tokens per tile, the kernel takes "
            f"{shape.tokens_per_block} ({shape})"
        )
    q = q.contiguous()
    num_tiles = prefix.tiles.numel() // TILE_FIELDS
    if num_tiles == 0:
        return
    _shared_prefix_kernel[(num_tiles, splits, kv_heads)](
        q,
        k_cache,
        v_cache,
        kv_slots,
        prefix.tiles,
        prefix.tokens,
        acc,
        m,
        lse,
        scale,
        splits,
        split0,
        q.stride(0),
        q.stride(1),
        *cache_strides(k_cache, v_cache),
        *partial_strides(acc, m),
        GROUP=heads // kv_heads,
        GROUP_PAD=triton.next_power_of_2(heads // kv_heads),
        ROWS=shape.rows,
        FIELDS=TILE_FIELDS,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=shape.block_n,
        IEEE=k_cache.dtype == torch.float32,
        num_warps=8 if shape.rows >= 128 else 4,  # a 128 x HEAD_DIM fp32 accumulator
    )
