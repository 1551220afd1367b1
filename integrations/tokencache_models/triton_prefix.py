"""Triton shared-prefix attention: a batch's common slot-list prefix read once for all rows.

When every real row of a forward starts with the same P slots (a shared system prompt; the radix
tree hands all of its requests the same KV slots), reading those slots once per row wastes
(rows - 1) x P slot reads per layer: at 32 rows x 8k that is nearly all of a decode step's
memory traffic. Here program (m, split, kvh) takes a block of the batch's query tokens with the
kv head's whole GQA group (PREFIX_ROWS rows), walks its split of the P prefix slots without a
mask (every new token comes after the prefix) and writes partial (acc, max, sum) triples into
extra split columns of the caller's partial buffers. The decode and varlen kernels then skip
the first P slots of each row (their SKIP mode) and one merge combines both (cascade
attention, as FlashInfer's and Hydragen's). P is read from a device tensor, so a CUDA graph
captured once serves any prefix length.

Imported lazily, on CUDA or under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .context import PREFIX_ROWS
from .triton_splitkv import attend_block, kv_block, load_query_block, store_partial

# Programs to aim for (~2 waves of a 132-SM GPU, as the other kernels) and a cap on splits.
SPLIT_TARGET = 264
MAX_SPLITS = 32
MIN_SPLIT_CHUNKS = 4  # host-known prefixes: no split shorter than this many BLOCK_N chunks


@triton.jit  # type: ignore[untyped-decorator]
def _shared_prefix_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Slots,
    KvOff,
    PrefixLen,
    Acc,
    M,
    L,
    sm_scale,
    num_tokens,
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
    TOKENS: tl.constexpr,  # ROWS // GROUP_PAD query tokens per program
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    mb = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    base = tl.load(KvOff)  # row 0's slot list starts with the prefix
    plen = tl.load(PrefixLen)
    per_split = tl.cdiv(tl.cdiv(plen, splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, plen)

    q, tok, head, row_ok, offs_d, d_mask = load_query_block(
        Q, 0, mb * TOKENS, num_tokens, kvh, stride_qt, stride_qh, ROWS, GROUP, GROUP_PAD,
        HEAD_DIM, BLOCK_D,
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


def prefix_rows(dtype: torch.dtype) -> int:
    """Query rows per program: PREFIX_ROWS, or 32 for fp32 caches (kv_block's reason)."""
    return PREFIX_ROWS if dtype.itemsize <= 2 else 32


def prefix_splits(
    num_tokens: int, heads: int, k_cache: torch.Tensor, prefix_len: int | None = None
) -> int:
    """Split columns the prefix kernel fills for a forward of num_tokens query tokens."""
    kv_heads, dtype = k_cache.shape[1], k_cache.dtype
    rows, block_n = prefix_rows(dtype), kv_block(dtype)
    return prefix_grid(num_tokens, heads, kv_heads, rows, prefix_len, block_n)[3]


def prefix_grid(
    num_tokens: int,
    heads: int,
    kv_heads: int,
    rows: int = PREFIX_ROWS,
    prefix_len: int | None = None,
    block_n: int = 64,
) -> tuple[int, int, int, int]:
    """(rows, tokens per block, m-blocks, splits) of the prefix kernel. prefix_len None: the
    split count from the grid only (decode under CUDA graphs, where P changes between replays);
    a host-known P also keeps each split >= MIN_SPLIT_CHUNKS blocks long."""
    group_pad = triton.next_power_of_2(heads // kv_heads)
    rows = max(rows, 16, group_pad)  # tl.dot needs M >= 16; a block holds >= 1 token
    tokens = rows // group_pad
    m_blocks = triton.cdiv(num_tokens, tokens)
    splits = min(triton.cdiv(SPLIT_TARGET, max(1, m_blocks * kv_heads)), MAX_SPLITS)
    if prefix_len is not None:
        splits = max(1, min(splits, prefix_len // (MIN_SPLIT_CHUNKS * block_n)))
    return rows, tokens, m_blocks, splits


def shared_prefix_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_offsets: torch.Tensor,
    prefix_len: torch.Tensor,
    acc: torch.Tensor,
    m: torch.Tensor,
    lse: torch.Tensor,
    split0: int,
    scale: float,
    rows: int | None = None,
    block_n: int | None = None,
) -> None:
    """Attention of every query row q [T, H, D] over the first prefix_len[0] entries of row 0's
    slot list (kv_slots[kv_offsets[0]:]), unmasked, written as partials into split columns
    [split0, acc.shape[2]) of acc [T, H, S, D] and m / lse [T, H, S] (fp32, contiguous). The
    caller's own kernels fill columns [0, split0) and merge_splits combines all of them.
    Launch parameters come from shapes only: no host sync, graph-capturable."""
    tokens_total, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    block_n = block_n or kv_block(k_cache.dtype)
    rows = rows or prefix_rows(k_cache.dtype)
    splits = acc.shape[2] - split0
    rows, tokens, m_blocks, _ = prefix_grid(tokens_total, heads, kv_heads, rows)
    assert splits >= 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = q.contiguous()
    _shared_prefix_kernel[(m_blocks, splits, kv_heads)](
        q,
        k_cache,
        v_cache,
        kv_slots,
        kv_offsets,
        prefix_len,
        acc,
        m,
        lse,
        scale,
        tokens_total,
        splits,
        split0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        m.stride(0),
        m.stride(1),
        GROUP=heads // kv_heads,
        GROUP_PAD=triton.next_power_of_2(heads // kv_heads),
        ROWS=rows,
        TOKENS=tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32,
        num_warps=8 if rows >= 128 else 4,  # a 128 x HEAD_DIM fp32 accumulator over 8 warps
    )
