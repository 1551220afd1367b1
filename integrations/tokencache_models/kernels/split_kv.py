"""What the Triton paged-attention kernels share: a block of query rows (tokens x GQA group),
one online-softmax step over a block of K/V slots, partial results per split and their merge
(flash-decoding).

Imported lazily with them, on CUDA or under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..shared_prefix.shape import kv_block_slots


def kv_block(dtype: torch.dtype) -> int:
    """K/V slots per online-softmax step (BLOCK_N) for a cache dtype (the rule of
    shared_prefix.shape)."""
    return kv_block_slots(dtype.itemsize)


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Every kernel's stride_ks, stride_kh, stride_vs, stride_vh: K's then V's (slot, head)
    strides (the head dim is contiguous)."""
    return k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)


def partial_strides(acc: torch.Tensor, m: torch.Tensor) -> tuple[int, ...]:
    """Every kernel's stride_at, stride_ah, stride_as, stride_mt, stride_mh: the partial
    buffers' (token, head, split) and (token, head) strides."""
    return acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1)


@triton.jit  # type: ignore[untyped-decorator]
def _query_rows(  # type: ignore[no-untyped-def]
    Q,
    tok,
    tok_ok,
    kvh,
    stride_qt,
    stride_qh,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Row r of the block: token tok[r] of Q (tok_ok[r]: it exists) with query head r % GROUP_PAD
    of the kv head's GQA group (padded to GROUP_PAD). Returns (q, head, row_ok, offs_d,
    d_mask)."""
    offs_d = tl.arange(0, BLOCK_D)
    g = tl.arange(0, ROWS) % GROUP_PAD
    row_ok = tok_ok & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    head = kvh * GROUP + g
    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_mask[None, :],
        other=0.0,
    )
    return q, head, row_ok, offs_d, d_mask


@triton.jit  # type: ignore[untyped-decorator]
def load_query_block(  # type: ignore[no-untyped-def]
    Q,
    q0,
    t0,
    q_len,
    kvh,
    stride_qt,
    stride_qh,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """ROWS query rows: tokens t0, t0 + 1, ... (of q_len, stored from row q0 of Q) x the kv
    head's GQA group (padded to GROUP_PAD), so K/V are loaded once for the whole group.
    Returns (q, tok, head, row_ok, offs_d, d_mask); tok: each row's token index in the request."""
    tok = t0 + tl.arange(0, ROWS) // GROUP_PAD
    q, head, row_ok, offs_d, d_mask = _query_rows(
        Q + q0 * stride_qt, tok, tok < q_len, kvh, stride_qt, stride_qh, ROWS, GROUP, GROUP_PAD,
        HEAD_DIM, BLOCK_D,
    )  # fmt: skip
    return q, tok, head, row_ok, offs_d, d_mask


@triton.jit  # type: ignore[untyped-decorator]
def load_query_tokens(  # type: ignore[no-untyped-def]
    Q,
    Tokens,
    t0,
    count,
    kvh,
    stride_qt,
    stride_qh,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """As load_query_block, for the tokens listed at Tokens[t0], Tokens[t0 + 1], ... (count
    of them) instead of a run of consecutive ones. Returns (q, tok, head, row_ok, offs_d,
    d_mask); tok: each row's token index in Q."""
    j = tl.arange(0, ROWS) // GROUP_PAD
    tok = tl.load(Tokens + t0 + j, mask=j < count, other=0)
    q, head, row_ok, offs_d, d_mask = _query_rows(
        Q, tok, j < count, kvh, stride_qt, stride_qh, ROWS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D
    )
    return q, tok, head, row_ok, offs_d, d_mask


@triton.jit
def store_partial(  # type: ignore[no-untyped-def]
    Acc,
    M,
    L,
    acc,
    m_i,
    l_i,
    token,
    head,
    col,
    row_ok,
    offs_d,
    d_mask,
    stride_at,
    stride_ah,
    stride_as,
    stride_mt,
    stride_mh,
):
    """Writes rows' unnormalised (acc, max, sum) into split column `col` of Acc [T, H, S, D]
    and M / L [T, H, S] (token: each row's index in T) for merge_splits."""
    tl.store(
        Acc + token[:, None] * stride_at + head[:, None] * stride_ah + col * stride_as
        + offs_d[None, :],
        acc,
        mask=row_ok[:, None] & d_mask[None, :],
    )  # fmt: skip
    row = token * stride_mt + head * stride_mh + col
    tl.store(M + row, m_i, mask=row_ok)
    tl.store(L + row, l_i, mask=row_ok)


@triton.jit  # type: ignore[untyped-decorator]
def store_empty_partials(  # type: ignore[no-untyped-def]
    Acc,
    M,
    L,
    token,
    head,
    col0,
    cols,
    row_ok,
    offs_d,
    d_mask,
    stride_at,
    stride_ah,
    stride_as,
    stride_mt,
    stride_mh,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Empty partials (acc 0, max -inf, sum 0: they weigh nothing in the merge) into split
    columns [col0, col0 + cols) for rows that no kernel attends there."""
    none = tl.full([ROWS], float("-inf"), tl.float32)
    zero = tl.zeros([ROWS], tl.float32)
    empty = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for col in range(col0, col0 + cols):
        store_partial(
            Acc, M, L, empty, none, zero, token, head, col, row_ok, offs_d, d_mask, stride_at,
            stride_ah, stride_as, stride_mt, stride_mh,
        )  # fmt: skip


@triton.jit  # type: ignore[untyped-decorator]
def attend_block(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    Slots,
    cols,
    n_mask,
    allowed,
    kvh,
    offs_d,
    d_mask,
    sm_scale,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    IEEE: tl.constexpr,
):
    """Gathers the K/V rows of slot-list entries `cols` (n_mask: real ones), scores the rows of
    q against them (allowed: [rows, BLOCK_N], what each row may attend to) and folds them into
    the running (acc, m_i, l_i). Returns the new triple."""
    slot = tl.load(Slots + cols, mask=n_mask, other=0).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    # fp32 caches ask for IEEE dots: the default tf32 would break fp32 exactness.
    if IEEE:  # noqa: SIM108 (plain if on a constexpr is the safest form in triton)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk.to(tl.float32) * sm_scale
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Rows with nothing allowed yet (padding rows, rows whose causal limit lies before this
    # split) keep m = -inf; avoid -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if IEEE:  # noqa: SIM108
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv.to(tl.float32)
    return acc, m_new, l_i


@triton.jit  # type: ignore[untyped-decorator]
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    Acc,
    M,
    L,
    Out,
    n_rows,
    splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Rows are (token, head) pairs of contiguous Acc [R, splits, D], M / L [R, splits] and
    # Out [R, D]; BLOCK_R rows per program keep the grid (and the interpreter) small.
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    rs_mask = (offs_r < n_rows)[:, None] & (offs_s < splits)[None, :]
    d_mask = offs_d < HEAD_DIM
    rs = offs_r.to(tl.int64)[:, None] * splits + offs_s[None, :]
    m = tl.load(M + rs, mask=rs_mask, other=float("-inf"))
    lse = tl.load(L + rs, mask=rs_mask, other=0.0)
    acc = tl.load(
        Acc + rs[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=rs_mask[:, :, None] & d_mask[None, None, :],
        other=0.0,
    )
    # Empty splits carry m = -inf and weigh zero; a row with no split at all stays finite.
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max[:, None])
    denom = tl.sum(lse * w, 1)
    out = tl.sum(acc * w[:, :, None], 1) / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        Out + offs_r.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=(offs_r < n_rows)[:, None] & d_mask[None, :],
    )


def merge_splits(acc: torch.Tensor, m: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """out[..., D] = the softmax-weighted merge of acc[..., splits, D] with its running maxima
    m[..., splits] and sums lse[..., splits]; all contiguous. One launch, shapes only (no host
    sync, graph-capturable)."""
    splits, head_dim = acc.shape[-2], acc.shape[-1]
    n_rows = out.numel() // head_dim
    if n_rows == 0:
        return
    splits_pad = triton.next_power_of_2(splits)
    block_r = max(1, 64 // splits_pad)  # a [BLOCK_R, SPLITS_PAD, BLOCK_D] tile
    _merge_splits_kernel[(triton.cdiv(n_rows, block_r),)](
        acc,
        m,
        lse,
        out,
        n_rows,
        splits,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        SPLITS_PAD=splits_pad,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
