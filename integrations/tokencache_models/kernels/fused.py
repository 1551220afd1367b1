"""Triton fusions of the layer's elementwise chains (GPU; tested under TRITON_INTERPRET=1).

Each replaces a chain of small torch ops (and their launches) by one kernel:
  add_rmsnorm          residual add + RMSNorm (8-9 ops -> 1), returning the new residual too
  qkv_norm_rope_store  from the merged q/k/v projection: per-head q/k RMSNorm (Qwen3) + rotary
                       embedding from positions, q in the cache dtype, k and v written to their
                       KV-pool rows (~40 ops and 2 index_copy_ -> 1)
  silu_mul             SwiGLU's silu(gate) * up, read from the merged gate/up output (2 ops -> 1)
They compute in fp32 and round once, where the torch chain rounds after every op in the model
dtype: equal in fp32 up to float reassociation, within bf16 rounding in bf16 (tests compare with
the unfused modules). Imported lazily, only when CausalLM.fused is on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def _add_rmsnorm_kernel(  # type: ignore[no-untyped-def]
    X,
    R,
    W,
    Y,
    ROut,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The residual add rounds to the model dtype, as `x + h` does in torch.
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)).to(
            X.dtype.element_ty
        )
        tl.store(ROut + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (h * inv).to(X.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); without a residual, (rmsnorm(x), x)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    n = x.shape[1]
    y = torch.empty_like(x)
    r_out = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    _add_rmsnorm_kernel[(x.shape[0],)](
        x,
        r,
        weight,
        y,
        r_out,
        x.stride(0),
        r.stride(0),
        y.stride(0),
        r_out.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(n),
        num_warps=8 if n >= 4096 else 4,  # one row per program: wide rows want more threads
    )
    return y, r_out


@triton.jit  # type: ignore[untyped-decorator]
def _qkv_norm_rope_store_kernel(  # type: ignore[no-untyped-def]
    X,
    QOut,
    KC,
    VC,
    Pos,
    Slots,
    InvFreq,
    QW,
    KW,
    stride_xt,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)  # q head hd, or k (and v) head hd - HEADS
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    # q heads, then k heads, then v heads along the merged row: q head hd and k head
    # hd - HEADS both start at column hd * head_dim.
    row = X + t * stride_xt
    x1 = tl.load(row + hd * (2 * HALF) + j, mask=mask, other=0.0)
    x2 = tl.load(row + hd * (2 * HALF) + HALF + j, mask=mask, other=0.0)
    dt = X.dtype.element_ty
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        if hd < HEADS:
            w1 = tl.load(QW + j, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(QW + HALF + j, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(KW + j, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(KW + HALF + j, mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / (2 * HALF) + eps)
        a = ((a * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        b = ((b * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    # fp32 angles, cos/sin rounded to the model dtype as the torch rotary module does.
    ang = tl.load(Pos + t).to(tl.float32) * tl.load(InvFreq + j, mask=mask, other=0.0)
    c = tl.cos(ang).to(dt).to(tl.float32)
    s = tl.sin(ang).to(dt).to(tl.float32)
    r1 = a * c - b * s
    r2 = b * c + a * s
    if hd < HEADS:
        qo = QOut + t * stride_qt + hd * stride_qh
        tl.store(qo + j, r1.to(QOut.dtype.element_ty), mask=mask)
        tl.store(qo + HALF + j, r2.to(QOut.dtype.element_ty), mask=mask)
    else:
        kv = hd - HEADS
        # Padding tokens all write the scratch slot: racing writes of values nothing reads.
        slot = tl.load(Slots + t).to(tl.int64)
        ko = KC + slot * stride_ks + kv * stride_kh
        tl.store(ko + j, r1.to(KC.dtype.element_ty), mask=mask)
        tl.store(ko + HALF + j, r2.to(KC.dtype.element_ty), mask=mask)
        # v head kv: column (HEADS + KV_HEADS + kv) * head_dim, copied as it is.
        v_in = row + (hd + KV_HEADS) * (2 * HALF)
        vo = VC + slot * stride_vs + kv * stride_vh
        v1 = tl.load(v_in + j, mask=mask, other=0.0)
        v2 = tl.load(v_in + HALF + j, mask=mask, other=0.0)
        tl.store(vo + j, v1.to(VC.dtype.element_ty), mask=mask)
        tl.store(vo + HALF + j, v2.to(VC.dtype.element_ty), mask=mask)


def qkv_norm_rope_store(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    positions: torch.Tensor,
    slots: torch.Tensor,
    inv_freq: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """From the merged projection qkv [T, (heads + 2 * kv_heads) * head_dim] (q, k, v heads in
    that order): q = rope(rmsnorm(q) * q_norm), returned [T, heads, head_dim] in the cache's
    dtype (what attention reads); k = rope(rmsnorm(k) * k_norm) and v written to rows `slots`
    [T] of k_cache / v_cache ([slots, kv_heads, head_dim], one pool layer) in their dtype.
    Norms skipped when q_norm / k_norm are None (Llama, Qwen2); positions: [T] int64;
    inv_freq: [head_dim // 2] fp32 on qkv's device."""
    t = qkv.shape[0]
    dim = k_cache.shape[-1]
    assert qkv.stride(-1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * dim and dim % 2 == 0
    assert k_cache.shape[1] == kv_heads and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert (q_norm is None) == (k_norm is None)
    q = torch.empty((t, heads, dim), device=qkv.device, dtype=k_cache.dtype)
    # Unused when HAS_NORM is off.
    qw = q_norm if q_norm is not None else inv_freq
    kw = k_norm if k_norm is not None else inv_freq
    _qkv_norm_rope_store_kernel[(t, heads + kv_heads)](
        qkv,
        q,
        k_cache,
        v_cache,
        positions,
        slots,
        inv_freq,
        qw,
        kw,
        qkv.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        eps,
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=dim // 2,
        BLOCK=triton.next_power_of_2(dim // 2),
        HAS_NORM=q_norm is not None,
    )
    return q


@triton.jit  # type: ignore[untyped-decorator]
def _silu_mul_kernel(GU, Y, n, stride_gu, stride_y, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounds to the model dtype before the product, as F.silu(g) * u does.
    s = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (s * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the merged projection gate_up [T, 2 * I] (gate's columns first),
    read in place: [T, I]."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty((t, n), device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        gate_up, y, n, gate_up.stride(0), y.stride(0), BLOCK=block
    )
    return y
