"""Triton paged varlen attention: prefill, extend and catch-up batches in one launch per layer.

Flash-attention over a ragged batch whose K/V live in pool slots. Program (b, m, kvh) takes a
block of request b's new tokens together with the kv head's whole GQA group (ROWS = tokens x
group rows, so K/V are loaded once per group), walks the request's slot list in BLOCK_N chunks
up to the block's causal limit with an online softmax, and writes its rows of the output. Token j
of a request with q_len new tokens and kv_len slots sits at slot-list index kv_len - q_len + j
(bottom-right causal), so shared prefixes and catch-ups need nothing special.

The grid comes from host-known numbers only (B, ceil(max_q_len / tokens per block), KVH): no host
sync. Imported lazily, on CUDA or under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def _paged_varlen_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Out,
    Slots,
    QOff,
    KvOff,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    TOKENS: tl.constexpr,  # ROWS // GROUP_PAD new tokens per program
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    kvh = tl.program_id(2)
    q0 = tl.load(QOff + b)
    q_len = tl.load(QOff + b + 1) - q0
    kv0 = tl.load(KvOff + b)
    kv_len = tl.load(KvOff + b + 1) - kv0
    t0 = mb * TOKENS

    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = t0 + offs_r // GROUP_PAD
    g = offs_r % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    head = kvh * GROUP + g
    q = tl.load(
        Q + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_mask[None, :],
        other=0.0,
    )
    limit = kv_len - q_len + tok  # last slot-list index each row may attend to
    # Columns this block needs: up to its last token's limit; none when it has no tokens.
    last_tok = tl.minimum(t0 + TOKENS, q_len) - 1
    hi = tl.where(t0 < q_len, kv_len - q_len + last_tok + 1, 0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols < hi
        slot = tl.load(Slots + kv0 + cols, mask=n_mask, other=0).to(tl.int64)
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
        allowed = n_mask[None, :] & (cols[None, :] <= limit[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Rows with nothing allowed yet (padding rows) keep m = -inf; avoid -inf - -inf.
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
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_mask[None, :],
    )


def paged_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    scale: float,
    max_q_len: int,
    rows: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """q: [T, H, D] (request i's new tokens at q_offsets[i]:q_offsets[i+1]); k_cache/v_cache:
    [slots, KVH, D]; kv_slots / kv_offsets: each request's slot list, ending with its new tokens'
    slots; max_q_len: host-known max of the q lengths (sets the grid). Returns [T, H, D]."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    rows = max(rows, 16, group_pad)  # tl.dot needs M >= 16; a block holds >= 1 token
    q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    bsz = q_offsets.numel() - 1
    tokens = rows // group_pad
    grid = (bsz, triton.cdiv(max_q_len, tokens), kv_heads)
    _paged_varlen_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        kv_slots,
        q_offsets,
        kv_offsets,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        ROWS=rows,
        TOKENS=tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32,
    )
    return out
