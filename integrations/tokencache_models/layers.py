"""Building blocks shared by Qwen3 and Llama: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, exactly as the HF Llama/Qwen3 modules do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with optional linear or llama3 scaling."""
    dim = config.head_dim
    # Explicit CPU: models are built under torch.device("meta"), which must not capture this.
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exps)
    scaling: dict[str, Any] = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        # Same formula as transformers' _compute_llama3_parameters (Llama 3.1 long-context).
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Produces cos/sin for arbitrary (ragged) positions; rotate-half convention as in HF.

    inv_freq is a plain attribute, not a buffer: Module.to(dtype) must never round it to bf16.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self._inv_freq_cpu = rope_inv_freq(config)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        return self._inv_freq[device]

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 angles regardless of the model dtype, as in HF.
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class MergedLinear:
    """Several nn.Linear over one input as one GEMM (q/k/v; gate/up): their weights (and
    biases) concatenated along the output features in one buffer, output features in the
    order given.

    The Linears stay what checkpoints, sharding and truncation see (HF names, one Parameter
    each); their parameters are re-pointed to views of the buffer, so memory is not doubled
    and in-place writes (load_state_dict's copy_) land in it. A parameter replaced or moved
    (Module.to() swaps `.data`, sharding assigns new Linears) no longer sits where the merge
    put it: each call compares the parameters' identities and addresses with the merge's
    (a few host calls) and merges again when they differ, i.e. on the first call and after
    such a change, never in a CUDA graph's capture (its warm-up call merges)."""

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._key: tuple[int, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        # The buffer travels as the Linears' parameters; the receiver merges again.
        return {"weight": None, "bias": None, "_key": ()}

    @staticmethod
    def _key_of(linears: Sequence[nn.Linear]) -> tuple[int, ...]:
        key: list[int] = []
        for lin in linears:
            for p in (lin.weight, lin.bias):
                if p is not None:
                    key += (id(p), p.data_ptr())
        return tuple(key)

    def __call__(self, x: torch.Tensor, linears: Sequence[nn.Linear]) -> torch.Tensor:
        if self._key_of(linears) != self._key:
            self.merge(linears)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def merge(self, linears: Sequence[nn.Linear]) -> None:
        biases = [lin.bias for lin in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("merged Linears must all have a bias or none")
        # Outside inference mode: the buffer becomes the parameters' storage, which must stay
        # writable by load_state_dict after the forward that merged.
        with torch.inference_mode(False), torch.no_grad():
            weight = torch.cat([lin.weight.detach() for lin in linears])
            bias = None
            if biases[0] is not None:
                bias = torch.cat([b.detach() for b in biases if b is not None])
            o = 0
            for lin in linears:
                n = lin.weight.shape[0]
                lin.weight.data = weight[o : o + n]
                if bias is not None:
                    lin.bias.data = bias[o : o + n]
                o += n
        self.weight, self.bias = weight, bias
        self._key = self._key_of(linears)


class SwiGLUMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gate_up = MergedLinear()

    def gate_up_proj(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I]: gate's features, then up's (one GEMM)."""
        return self.gate_up(x, (self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out
