"""Tensor parallelism over torch.distributed: sharded layers and a model's shard for one rank.

Megatron's split: q/k/v, gate and up are column-parallel (each rank holds a slice of the output
features: its heads, its part of the MLP), o_proj and down are row-parallel (a slice of the
input features, partial sums all-reduced), so a decoder layer costs one all-reduce after
attention and one after the MLP. The embedding and the LM head are split by vocabulary rows:
the embedding's ranks each look up the ids they hold (zeros elsewhere) and all-reduce, the
head's ranks each compute their rows' logits and all-gather them. Norms are replicated.

Each rank's KV pool holds its own KV heads (`shard_config`); slot ids mean the same on every
rank, so the radix tree, the cursors and the slot table stay with the engine's rank.

Nothing here reads device memory back on the host: the collectives are plain c10d calls on
tensors of host-known shapes, which NCCL captures in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .config import ModelConfig

if TYPE_CHECKING:
    from .model import CausalLM

# fetch(name, dim, start, stop): the checkpoint tensor `name`, sliced [start, stop) along dim
# (dim None: the whole tensor). A state dict or a safetensors file's get_slice behind it.
Fetch = Callable[[str, "int | None", int, int], torch.Tensor]


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group. `group` carries the forward's
    collectives (NCCL on CUDA, gloo on CPU); world 1 issues none."""

    rank: int
    world: int
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[world * n, ...]: every rank's x stacked in rank order (one collective)."""
        if self.world == 1:
            return x
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        # all_gather_single: torch 2.13's name for all_gather_into_tensor (now deprecated).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return out


def check_divisible(config: ModelConfig, world: int) -> None:
    """Heads, KV heads and the MLP must split evenly (replicating KV heads over ranks, for
    models with fewer KV heads than ranks, is not implemented)."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world:
            raise ValueError(f"tensor parallelism {world}: {name}={value} does not split evenly")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shapes one rank computes: its heads, KV heads and MLP slice (vocab and hidden whole).
    Its KV pool and the attention kernels' shapes come from it."""
    check_divisible(config, world)
    if world == 1:
        return config
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // world,
        num_key_value_heads=config.num_key_value_heads // world,
        intermediate_size=config.intermediate_size // world,
    )


class ColumnParallelLinear(nn.Linear):
    """A slice of the output features; no communication (its consumer is rank-local)."""


class RowParallelLinear(nn.Linear):
    """A slice of the input features: each rank's partial product, summed by one all-reduce
    (in place on the GEMM's output, so a CUDA graph captures it over its own buffer)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


def vocab_shard(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, rows): rank's vocabulary rows [start, stop), its shard padded to rows =
    ceil(vocab / world) (the padding rows' logits are dropped after the gather)."""
    rows = -(-vocab // world)
    start = min(vocab, rank * rows)
    return start, min(vocab, start + rows), rows


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding: ids elsewhere look up zeros; one all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.stop, self.tp = start, stop, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


class VocabParallelLMHead(nn.Module):
    """Rows of the LM head (padded to equal shards; tied: the embedding's own parameter); each
    rank's logits all-gathered and put back in vocabulary order."""

    def __init__(self, weight: torch.Tensor | nn.Parameter, vocab: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.weight.requires_grad_(False)
        self.vocab, self.tp = vocab, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight)  # [B, rows]
        if self.tp.world == 1:
            return local[:, : self.vocab]
        b, rows = local.shape
        full = self.tp.all_gather_rows(local)  # [world * B, rows], rank-major
        full = full.view(self.tp.world, b, rows).transpose(0, 1).reshape(b, -1)
        return full[:, : self.vocab]


def _param(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(t.to(device=device, dtype=dtype).contiguous(), requires_grad=False)


def build_shard(
    config: ModelConfig,
    tp: TPGroup,
    fetch: Fetch,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
) -> CausalLM:
    """Rank tp.rank's shard of a model whose HF-named tensors `fetch` slices (a rank reads
    only its slices: a checkpoint never needs to fit one device)."""
    from .model import Attention, CausalLM, DecoderLayer

    device = torch.device(device)
    world, rank = tp.world, tp.rank
    local = shard_config(config, world)
    with torch.device("meta"):
        model = CausalLM(config, attention_backend)
    d = config.head_dim
    qh, kvh, inter = local.num_attention_heads, local.num_key_value_heads, local.intermediate_size
    h = config.hidden_size

    def column(name: str, out: int, bias: bool) -> ColumnParallelLinear:
        lin = ColumnParallelLinear(h, out, bias=bias, device="meta")
        lin.weight = _param(fetch(f"{name}.weight", 0, rank * out, (rank + 1) * out), device, dtype)
        if bias:
            lin.bias = _param(fetch(f"{name}.bias", 0, rank * out, (rank + 1) * out), device, dtype)
        return lin

    def row(name: str, width: int) -> RowParallelLinear:
        with torch.device("meta"):
            lin = RowParallelLinear(width, h, tp)
        lin.weight = _param(
            fetch(f"{name}.weight", 1, rank * width, (rank + 1) * width), device, dtype
        )
        return lin

    def whole(name: str) -> nn.Parameter:
        return _param(fetch(name, None, 0, 0), device, dtype)

    start, stop, rows = vocab_shard(config.vocab_size, rank, world)

    def vocab_rows(name: str) -> torch.Tensor:
        w = torch.zeros(rows, h, device=device, dtype=dtype)
        if stop > start:
            w[: stop - start] = fetch(name, 0, start, stop).to(device=device, dtype=dtype)
        return w

    embed = VocabParallelEmbedding(vocab_rows("model.embed_tokens.weight"), start, stop, tp)
    model.model.embed_tokens = embed  # type: ignore[assignment]
    head_w = embed.weight if config.tie_word_embeddings else vocab_rows("lm_head.weight")
    model.lm_head = VocabParallelLMHead(head_w, config.vocab_size, tp)  # type: ignore[assignment]
    model.model.norm.weight = whole("model.norm.weight")
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}"
        attn: Attention = layer.self_attn
        attn.num_heads, attn.num_kv_heads = qh, kvh
        bias = config.qkv_bias
        attn.q_proj = column(f"{p}.self_attn.q_proj", qh * d, bias)
        attn.k_proj = column(f"{p}.self_attn.k_proj", kvh * d, bias)
        attn.v_proj = column(f"{p}.self_attn.v_proj", kvh * d, bias)
        attn.o_proj = row(f"{p}.self_attn.o_proj", qh * d)
        if attn.qk_norm:
            attn.q_norm.weight = whole(f"{p}.self_attn.q_norm.weight")
            attn.k_norm.weight = whole(f"{p}.self_attn.k_norm.weight")
        layer.mlp.gate_proj = column(f"{p}.mlp.gate_proj", inter, False)
        layer.mlp.up_proj = column(f"{p}.mlp.up_proj", inter, False)
        layer.mlp.down_proj = row(f"{p}.mlp.down_proj", inter)
        layer.input_layernorm.weight = whole(f"{p}.input_layernorm.weight")
        layer.post_attention_layernorm.weight = whole(f"{p}.post_attention_layernorm.weight")
    # Every parameter replaced: none is left on the skeleton's meta device (unless meta is
    # the target, as in the no-host-sync tests).
    left = [n for n, t in model.named_parameters() if t.is_meta and device.type != "meta"]
    if left:
        raise RuntimeError(f"shard left parameters unset: {left[:4]}")
    model.tp_group = tp
    model.shard_config = local
    return model.eval()


def state_dict_fetch(state: dict[str, torch.Tensor]) -> Fetch:
    def fetch(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        t = state[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return fetch


def shard_model(model: CausalLM, tp: TPGroup, device: torch.device | str | None = None) -> CausalLM:
    """Rank tp.rank's shard of a loaded model (every rank holds the whole model first: fine
    for tests and small models; checkpoints: load_hf_checkpoint_shard)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return build_shard(
        model.config,
        tp,
        state_dict_fetch(state),
        device or model.device,
        model.dtype,
        model.attention_backend_name,
    )


def load_hf_checkpoint_shard(
    path: str,
    tp: TPGroup,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attention_backend: str = "auto",
) -> CausalLM:
    """Rank tp.rank's shard straight from a checkpoint's safetensors (only its slices read)."""
    from pathlib import Path

    from safetensors import safe_open

    from .loader import _dtype_from_config

    config = ModelConfig.from_pretrained_dir(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is not iterable)
                where[key] = f

    def fetch(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"checkpoint has no tensor {name}")
        with safe_open(str(where[name]), framework="pt", device="cpu") as sf:
            sl = sf.get_slice(name)
            index = [slice(None)] * len(sl.get_shape())
            if dim is not None:
                index[dim] = slice(start, stop)
            t: torch.Tensor = sl[tuple(index)]
            return t

    dtype = dtype or _dtype_from_config(config.extra)
    return build_shard(config, tp, fetch, device, dtype, attention_backend)
