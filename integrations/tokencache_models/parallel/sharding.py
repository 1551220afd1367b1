"""One rank's shard of a model: its layers cut into the tensor-parallel ones of tp_layers.py,
from a loaded model (shard_model) or straight from a checkpoint's safetensors, reading only
the rank's slices (load_hf_checkpoint_shard)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..loader import _dtype_from_config
from ..model import Attention, CausalLM, DecoderLayer
from .tp_layers import (
    ColumnParallelLinear,
    Fetch,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    kv_head_of,
    shard_config,
    vocab_shard,
)


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

    device = torch.device(device)
    world, rank = tp.world, tp.rank
    local = shard_config(config, world)
    with torch.device("meta"):
        model = CausalLM(config, attention_backend)
    d = config.head_dim
    qh, kvh, inter = local.num_attention_heads, local.num_key_value_heads, local.intermediate_size
    h = config.hidden_size

    def column(name: str, out: int, bias: bool, first: int | None = None) -> ColumnParallelLinear:
        """Output rows [first, first + out) (default: rank's out-wide slice)."""
        lo = rank * out if first is None else first
        lin = ColumnParallelLinear(h, out, bias=bias, device="meta")
        lin.weight = _param(fetch(f"{name}.weight", 0, lo, lo + out), device, dtype)
        if bias:
            lin.bias = _param(fetch(f"{name}.bias", 0, lo, lo + out), device, dtype)
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
    # K/V rows: this rank's KV heads (a replicated one's copy when fewer KV heads than ranks).
    kv_first = kv_head_of(rank, config.num_key_value_heads, world) * d

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
        attn.k_proj = column(f"{p}.self_attn.k_proj", kvh * d, bias, kv_first)
        attn.v_proj = column(f"{p}.self_attn.v_proj", kvh * d, bias, kv_first)
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
    model.merge_projections()  # this rank's q/k/v and gate/up slices, one GEMM each
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
