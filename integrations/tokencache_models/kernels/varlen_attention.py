"""Triton paged varlen attention: prefill, extend and catch-up batches in one launch per layer.

Flash-attention over a ragged batch whose K/V live in pool slots. Program (b, m, kvh) takes a
block of request b's new tokens together with the kv head's whole GQA group (ROWS = tokens x
group rows, so K/V are loaded once per group), walks the request's slot list in BLOCK_N chunks
up to the block's causal limit with an online softmax, and writes its rows of the output. Token j
of a request with q_len new tokens and kv_len slots sits at slot-list index kv_len - q_len + j
(bottom-right causal), so shared prefixes and catch-ups need nothing special.

Split-KV (flash-decoding): a catch-up batch (few requests, few new tokens, long contexts) makes a
tiny grid whose programs each walk thousands of slots. Then each block's column range is cut
into `splits` BLOCK_N-aligned chunks (folded into grid axis 1), each program writes a partial
(unnormalised acc, max, sum) in fp32, and a small merge kernel combines them. Big grids (long
prefills) keep one split and write the output directly, as before.

The grid comes from host-known numbers only (B, ceil(max_q_len / tokens per block), KVH, the
slot list's length): no host sync. Imported lazily, on CUDA or under TRITON_INTERPRET=1.
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
    load_query_block,
    merge_splits,
    partial_strides,
    store_empty_partials,
    store_partial,
)

# Programs to aim for: ~2 waves of a 132-SM GPU, as decode_attention.num_splits.
SPLIT_TARGET = 264
MAX_SPLITS = 32
# A split shorter than this many BLOCK_N chunks (on average) costs more in partials and merge
# than its extra parallelism saves.
MIN_SPLIT_CHUNKS = 4


@triton.jit  # type: ignore[untyped-decorator]
def _paged_varlen_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Out,
    Acc,
    M,
    L,
    Slots,
    QOff,
    KvStart,
    KvLen,
    Skip,
    sm_scale,
    splits,
    prefix_cols,  # split columns after this kernel's own that the prefix kernel fills
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_at,
    stride_ah,
    stride_as,
    stride_mt,
    stride_mh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    TOKENS: tl.constexpr,  # ROWS // GROUP_PAD new tokens per program
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    PARTIAL: tl.constexpr,  # write (acc, m, l) per split to Acc/M/L instead of Out
    SKIP: tl.constexpr,  # each row's first Skip[b] slots are its group's prefix, read elsewhere
):
    b = tl.program_id(0)
    mb = tl.program_id(1) // splits
    split = tl.program_id(1) % splits
    kvh = tl.program_id(2)
    q0 = tl.load(QOff + b)
    q_len = tl.load(QOff + b + 1) - q0
    kv0 = tl.load(KvStart + b)
    kv_len = tl.load(KvLen + b)
    if SKIP:
        # Causal limits are relative to the slot list's end, so dropping its head is enough.
        row_skip = tl.load(Skip + b)
        skip = tl.minimum(row_skip, kv_len - q_len)
        kv0 += skip
        kv_len -= skip
    t0 = mb * TOKENS

    q, tok, head, row_ok, offs_d, d_mask = load_query_block(
        Q, q0, t0, q_len, kvh, stride_qt, stride_qh, ROWS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D
    )
    offs_n = tl.arange(0, BLOCK_N)
    limit = kv_len - q_len + tok  # last slot-list index each row may attend to
    # Columns this block needs: up to its last token's limit; none when it has no tokens.
    last_tok = tl.minimum(t0 + TOKENS, q_len) - 1
    hi = tl.where(t0 < q_len, kv_len - q_len + last_tok + 1, 0)
    # This split's share of [0, hi), BLOCK_N-aligned; shares past hi are empty (m = -inf, l = 0).
    per_split = tl.cdiv(tl.cdiv(hi, splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    end = tl.minimum(lo + per_split, hi)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols < end
        allowed = n_mask[None, :] & (cols[None, :] <= limit[:, None])
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, K, V, Slots + kv0, cols, n_mask, allowed, kvh, offs_d, d_mask,
            sm_scale, stride_ks, stride_kh, stride_vs, stride_vh, IEEE,
        )  # fmt: skip

    if PARTIAL:
        store_partial(
            Acc, M, L, acc, m_i, l_i, q0 + tok, head, split, row_ok, offs_d, d_mask, stride_at,
            stride_ah, stride_as, stride_mt, stride_mh,
        )  # fmt: skip
        if SKIP:  # noqa: SIM102 (row_skip exists in SKIP kernels only: a constexpr branch)
            # A request outside every group: no prefix tile covers its tokens, so their prefix
            # columns are written empty here (m = -inf, l = 0, acc = 0) for the merge.
            if (row_skip == 0) & (split == 0):
                store_empty_partials(
                    Acc, M, L, q0 + tok, head, splits, prefix_cols, row_ok, offs_d, d_mask,
                    stride_at, stride_ah, stride_as, stride_mt, stride_mh, ROWS, BLOCK_D,
                )  # fmt: skip
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & d_mask[None, :],
        )


def varlen_grid(
    bsz: int,
    max_q_len: int,
    heads: int,
    kv_heads: int,
    kv_total: int,
    rows: int = 64,
    block_n: int = 64,
) -> tuple[int, int, int, int]:
    """(rows, tokens per block, m-blocks, splits) for a batch; host numbers only (kv_total is
    the slot list's length, a shape). One split once the grid fills ~2 waves (long prefills)."""
    group_pad = triton.next_power_of_2(heads // kv_heads)
    rows = max(rows, 16, group_pad)  # tl.dot needs M >= 16; a block holds >= 1 token
    tokens = rows // group_pad
    m_blocks = triton.cdiv(max_q_len, tokens)
    programs = max(1, bsz * m_blocks * kv_heads)
    want = min(triton.cdiv(SPLIT_TARGET, programs), MAX_SPLITS)
    avg_kv = kv_total // max(1, bsz)
    splits = max(1, min(want, avg_kv // (MIN_SPLIT_CHUNKS * block_n)))
    return rows, tokens, m_blocks, splits


def paged_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    rows: int | None = None,
    block_n: int | None = None,
    *,
    kv_total: int | None = None,
    splits: int | None = None,
    prefix: SharedPrefix | None = None,
) -> torch.Tensor:
    """q: [T, H, D] (request i's new tokens at q_offsets[i]:q_offsets[i+1]); k_cache/v_cache:
    [slots, KVH, D]; request i's slot list is kv_slots[kv_starts[i] : kv_starts[i] + kv_lens[i]]
    (a flat slot list or the slot table), ending with its new tokens' slots; kv_total: the
    host-known sum of kv_lens (None: kv_slots.numel(), right for a concatenated list);
    max_q_len: host-known max of the q lengths (sets the grid); rows / block_n: the tile
    (None: 64 x 64, or 32 x 32 for fp32 caches, whose IEEE dots spill at 64 x 64); splits: force the
    split-KV count (None: varlen_grid's choice); prefix: None, or the forward's shared-prefix
    tables with their host facts (HostBatch.prefix_groups): each group's prefix is read once for
    its rows by the shared-prefix kernel and skipped here. Returns [T, H, D]."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    bsz = q_offsets.numel() - 1
    block_n = block_n or kv_block(k_cache.dtype)
    rows = rows or kv_block(k_cache.dtype)  # the same rule: 64, or 32 for fp32's IEEE dots
    kv_total = kv_slots.numel() if kv_total is None else kv_total
    kv_read = kv_total - ((prefix.skipped or 0) if prefix is not None else 0)
    rows, tokens, m_blocks, auto = varlen_grid(
        bsz, max_q_len, heads, kv_heads, kv_read, rows, block_n
    )
    splits = auto if splits is None else max(1, splits)
    extra = 0 if prefix is None else prefix_splits(q, k_cache, prefix.longest)
    q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)  # contiguous, as the merge kernel assumes
    partial = splits + extra > 1
    if partial:
        # Every real row is written by every split (empty ones write m = -inf, l = 0).
        acc = torch.empty(
            (q.shape[0], heads, splits + extra, head_dim), device=q.device, dtype=torch.float32
        )
        m = torch.empty((q.shape[0], heads, splits + extra), device=q.device, dtype=torch.float32)
        lse = torch.empty_like(m)
    else:
        acc = m = lse = out  # unused (PARTIAL=False)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_varlen_kernel[(bsz, m_blocks * splits, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        acc,
        m,
        lse,
        kv_slots,
        q_offsets,
        kv_starts,
        kv_lens,
        kv_lens if prefix is None else prefix.row_skip,
        scale,
        splits,
        extra,
        q.stride(0),
        q.stride(1),
        *cache_strides(k_cache, v_cache),
        out.stride(0),
        out.stride(1),
        *partial_strides(acc, m),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        ROWS=rows,
        TOKENS=tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32,
        PARTIAL=partial,
        SKIP=prefix is not None,
    )
    if prefix is not None:
        shared_prefix_partials(q, k_cache, v_cache, kv_slots, prefix, acc, m, lse, splits, scale)
    if partial:
        merge_splits(acc, m, lse, out)
    return out
