"""Triton fusions of the layer's elementwise chains (GPU; tested under TRITON_INTERPRET=1).

Each replaces a chain of small torch ops (and their launches) by one kernel:
  add_rmsnorm   residual add + RMSNorm (8-9 ops -> 1), returning the new residual too
  qk_norm_rope  per-head RMSNorm (Qwen3) + rotary embedding from positions (~20 ops -> 1 per q/k)
  silu_mul      SwiGLU's silu(gate) * up (2 ops -> 1)
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
def _qk_norm_rope_kernel(  # type: ignore[no-untyped-def]
    X,
    Out,
    Pos,
    InvFreq,
    W,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    eps,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0)
    hd = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    base = X + t * stride_xt + hd * stride_xh
    x1 = tl.load(base + j, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + j, mask=mask, other=0.0)
    dt = X.dtype.element_ty
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / (2 * HALF) + eps)
        w1 = tl.load(W + j, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + j, mask=mask, other=0.0).to(tl.float32)
        a = ((a * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        b = ((b * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    # fp32 angles, cos/sin rounded to the model dtype as the torch rotary module does.
    ang = tl.load(Pos + t).to(tl.float32) * tl.load(InvFreq + j, mask=mask, other=0.0)
    c = tl.cos(ang).to(dt).to(tl.float32)
    s = tl.sin(ang).to(dt).to(tl.float32)
    ob = Out + t * stride_ot + hd * stride_oh
    tl.store(ob + j, (a * c - b * s).to(Out.dtype.element_ty), mask=mask)
    tl.store(ob + HALF + j, (b * c + a * s).to(Out.dtype.element_ty), mask=mask)


def qk_norm_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """x: [T, heads, head_dim] -> rope(rmsnorm(x) * w) (norm skipped when norm_weight is None);
    positions: [T] int64; inv_freq: [head_dim // 2] fp32 on x's device."""
    t, heads, dim = x.shape
    assert x.stride(-1) == 1 and dim % 2 == 0
    out = torch.empty((t, heads, dim), device=x.device, dtype=x.dtype)
    w = norm_weight if norm_weight is not None else inv_freq  # unused when HAS_NORM is off
    _qk_norm_rope_kernel[(t, heads)](
        x,
        out,
        positions,
        inv_freq,
        w,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        eps,
        HALF=dim // 2,
        BLOCK=triton.next_power_of_2(dim // 2),
        HAS_NORM=norm_weight is not None,
    )
    return out


@triton.jit  # type: ignore[untyped-decorator]
def _silu_mul_kernel(G, U, Y, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    # silu rounds to the model dtype before the product, as F.silu(g) * u does.
    s = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (s * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    block = 1024
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, y, n, BLOCK=block)
    return y
