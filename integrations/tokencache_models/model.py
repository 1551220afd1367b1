"""Decoder-only Qwen3 / Llama model whose layers read and write a paged KV pool.

Parameter names match the Hugging Face checkpoints (model.layers.N.self_attn.q_proj.weight, ...),
so a HF state dict loads with load_state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .attention import AttnTables, TorchPagedAttention, make_attention_backend, triton_available
from .config import ModelConfig
from .executor.model_executor import ModelExecutor, PreparedStep, TPHooks
from .forward.context import ForwardContext, ForwardOutput, HostBatch
from .forward.epilogue import Epilogue
from .forward.forward_batch import ForwardBatch
from .kv.pool import KVPool
from .layers import MergedLinear, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rope
from .parallel.tp_layers import TPGroup

# Re-exported where they used to live (ForwardOutput: context; PreparedStep, TPHooks: executor).
__all__ = [
    "Attention",
    "CausalLM",
    "DecoderBody",
    "DecoderLayer",
    "ForwardOutput",
    "LayerContext",
    "PreparedStep",
    "TPHooks",
]

# Forward switches that moved to the executor (model.executor): setting one on the model would
# silently do nothing, so it is refused with a pointer.
MOVED_TO_EXECUTOR = frozenset(
    {"decode_padding", "decode_graphs", "decode_runner", "decode_buckets"}
)


@dataclass(frozen=True)
class LayerContext:
    """What every layer reads in one forward: the built context and what the network derives
    from it on the device once, before the first layer (the backend's tables, the RoPE inputs).
    Made by CausalLM.run, never changed (the ForwardContext itself is frozen too)."""

    ctx: ForwardContext
    pool: KVPool
    backend: TorchPagedAttention
    attn: AttnTables  # backend.prepare(ctx)
    fused: bool  # run the Triton fusions (kernels/fused.py) instead of the torch op chains
    cos: torch.Tensor | None = None  # unfused RoPE
    sin: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None  # fused RoPE: rotary inverse frequencies


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h, d = config.hidden_size, config.head_dim
        # Qwen2: biases on q/k/v only (named like HF's ...q_proj.bias); o_proj never has one.
        qkv_bias = config.qkv_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.qkv = MergedLinear()
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        """[T, (heads + 2 * kv_heads) * head_dim]: q's features, then k's, then v's (one GEMM)."""
        return self.qkv(x, (self.q_proj, self.k_proj, self.v_proj))

    def forward(self, x: torch.Tensor, lc: LayerContext) -> torch.Tensor:
        ctx = lc.ctx
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        # The store views include the scratch row that padding tokens write.
        k_cache, v_cache = lc.pool.k_store[self.layer_idx], lc.pool.v_store[self.layer_idx]
        if lc.fused:
            from .kernels.fused import qkv_norm_rope_store

            assert lc.inv_freq is not None
            qw = self.q_norm.weight if self.qk_norm else None
            kw = self.k_norm.weight if self.qk_norm else None
            eps = self.q_norm.eps if self.qk_norm else 0.0
            # K/V land in the pool before attention, which then reads prefix and new tokens
            # uniformly; q comes back in the cache dtype (no cast of its own).
            q = qkv_norm_rope_store(
                qkv, h, kvh, ctx.positions, ctx.out_slots, lc.inv_freq, qw, kw, eps, k_cache,
                v_cache,
            )  # fmt: skip
        else:
            assert lc.cos is not None and lc.sin is not None
            q = qkv[:, : h * d].view(t, h, d)
            k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, lc.cos, lc.sin), apply_rope(k, lc.cos, lc.sin)
            # Write every new token's K/V first, so attention reads prefix and new tokens
            # uniformly.
            k_cache.index_copy_(0, ctx.out_slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, ctx.out_slots, v.to(v_cache.dtype))
            q = q.to(k_cache.dtype)
        o = lc.backend.forward(q, k_cache, v_cache, ctx, lc.attn, self.scale)
        out: torch.Tensor = self.o_proj(o.to(x.dtype).reshape(t, h * d))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SwiGLUMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, lc: LayerContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), lc)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out

    def forward_fused(
        self, h: torch.Tensor, residual: torch.Tensor | None, lc: LayerContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the residual adds carried into the next norm (one kernel each):
        takes (h, residual) with x = h + residual (residual None: x = h), returns the pair for
        the next layer."""
        from .kernels.fused import add_rmsnorm, silu_mul

        n1, n2, mlp = self.input_layernorm, self.post_attention_layernorm, self.mlp
        y, residual = add_rmsnorm(h, residual, n1.weight, n1.eps)
        y, residual = add_rmsnorm(self.self_attn(y, lc), residual, n2.weight, n2.eps)
        out: torch.Tensor = mlp.down_proj(silu_mul(mlp.gate_up_proj(y)))
        return out, residual


class DecoderBody(nn.Module):
    """Named like HF's `model.` submodule so checkpoint keys map one to one."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Qwen3 / Qwen2 / Llama causal LM over a paged KV pool: the network.

    run(ctx, pool, backend) is the forward body over a built context (device work only). How a
    forward runs (host preparation, padding, CUDA-graph replay, tensor-parallel metadata) is
    the executor's (`self.executor`, executor.ModelExecutor); prepare / execute / forward are
    delegations to it: forward() takes one ragged ForwardBatch (prefill, extend and decode
    requests mixed) and returns next-token logits and final hidden states for each request's
    last new token.
    """

    def __init__(self, config: ModelConfig, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.attention_backend_name = attention_backend
        self._backends: dict[str, TorchPagedAttention] = {}
        # Triton fusions of the elementwise chains (kernels/fused.py); None: on when on CUDA.
        self.fused: bool | None = None
        # Tensor parallelism (parallel.sharding.build_shard): this rank's group and the shapes it
        # computes (its heads and KV heads: its pool's and kernels' shapes); `tp` the runtime
        # that mirrors pools and forwards to worker ranks (on the engine's rank only).
        self.tp_group: TPGroup | None = None
        self.shard_config: ModelConfig = config
        self.tp: TPHooks | None = None
        self.executor = ModelExecutor(self)
        self.tie_weights()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in MOVED_TO_EXECUTOR:
            raise AttributeError(
                f"CausalLM.{name} moved to the executor: set model.executor.{name} instead"
            )
        super().__setattr__(name, value)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def merge_projections(self) -> None:
        """Each layer's q/k/v and gate/up weights into one buffer each (MergedLinear), now
        rather than on the first forward: the loaders then copy a checkpoint straight into the
        merged buffers, and no forward allocates them."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv.merge((attn.q_proj, attn.k_proj, attn.v_proj))
            mlp.gate_up.merge((mlp.gate_proj, mlp.up_proj))

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def make_kv_pool(self, num_slots: int, dtype: torch.dtype | None = None) -> KVPool:
        """A pool over this rank's KV heads (all of them without tensor parallelism)."""
        pool = KVPool.for_config(self.shard_config, num_slots, self.device, dtype or self.dtype)
        if self.tp is not None:
            self.tp.pool_made(pool)
        return pool

    def kv_pool_from_budget(self, budget_bytes: int, dtype: torch.dtype | None = None) -> KVPool:
        """As many slots as fit budget_bytes on this rank (every rank's shard the same)."""
        dtype = dtype or self.dtype
        num_slots = budget_bytes // KVPool.bytes_per_slot(self.shard_config, dtype)
        if num_slots <= 0:
            raise ValueError(f"budget of {budget_bytes} bytes holds no KV slot")
        return self.make_kv_pool(int(num_slots), dtype)

    def attention(self, name: str | None = None) -> TorchPagedAttention:
        """The attention backend for `name` (default: the model's), built once per model."""
        name = name or self.attention_backend_name
        backend = self._backends.get(name)
        if backend is None:
            backend = self._backends[name] = make_attention_backend(name, self.device)
        return backend

    def uses_fusions(self) -> bool:
        if self.fused is not None:
            return self.fused
        return self.device.type == "cuda" and triton_available()

    # -- the executor's entry points, kept on the model (delegations) -------------------------

    def forward(
        self,
        batch: ForwardBatch | HostBatch,
        pool: KVPool,
        attention_backend: str | None = None,
        context: ForwardContext | None = None,
    ) -> ForwardOutput:
        """One ragged batch over the pool (ModelExecutor.forward)."""
        return self.executor.forward(batch, pool, attention_backend, context)

    def prepare(
        self,
        batch: ForwardBatch | HostBatch,
        pool: KVPool,
        attention_backend: str | None = None,
        epilogue: Epilogue | None = None,
    ) -> PreparedStep:
        """A forward's host work (ModelExecutor.prepare)."""
        return self.executor.prepare(batch, pool, attention_backend, epilogue)

    def execute(self, step: PreparedStep) -> ForwardOutput:
        """A prepared forward's device work (ModelExecutor.execute)."""
        return self.executor.execute(step)

    # -- the network's forward body -------------------------------------------------------

    @torch.inference_mode()
    def run(self, ctx: ForwardContext, pool: KVPool, backend: TorchPagedAttention) -> ForwardOutput:
        """The forward body over a built context: device work only (no .item/.tolist/.cpu, no
        data-dependent shape), so it can be captured in a CUDA graph when the context's tensors
        are static buffers. What it derives from the context (the backend's tables, RoPE) is
        made once here, in a frozen LayerContext, before the first layer."""
        attn = backend.prepare(ctx)
        x = self.model.embed_tokens(ctx.token_ids)
        # Only each request's last token needs the final norm and the head. Padding rows go
        # through the head too (same GEMM shapes as the graph, hence the same rounding), then drop.
        last, norm = ctx.last_token, self.model.norm
        if self.uses_fusions():
            from .kernels.fused import add_rmsnorm

            inv_freq = self.rotary.inv_freq(x.device)
            lc = LayerContext(ctx, pool, backend, attn, fused=True, inv_freq=inv_freq)
            residual = None
            for layer in self.model.layers:
                x, residual = cast(DecoderLayer, layer).forward_fused(x, residual, lc)
            if residual is not None and type(norm) is RMSNorm:
                # The last residual add joins the final norm, over the last tokens only. An
                # early-exit head (an RMSNorm subclass) keeps its own forward.
                x, residual = x.index_select(0, last), residual.index_select(0, last)
                hidden, _ = add_rmsnorm(x, residual, norm.weight, norm.eps)
            else:
                x = x if residual is None else x + residual
                hidden = norm(x.index_select(0, last))
        else:
            cos, sin = self.rotary(ctx.positions, x.dtype)
            lc = LayerContext(ctx, pool, backend, attn, fused=False, cos=cos, sin=sin)
            for layer in self.model.layers:
                x = layer(x, lc)
            hidden = norm(x.index_select(0, last))
        logits = self.lm_head(hidden).float()
        if ctx.num_real < ctx.num_requests:
            hidden, logits = hidden[: ctx.num_real], logits[: ctx.num_real]
        return ForwardOutput(logits=logits, hidden=hidden)
