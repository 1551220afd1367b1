"""Decoder-only Qwen3 / Llama model whose layers read and write a paged KV pool.

Parameter names match the Hugging Face checkpoints (model.layers.N.self_attn.q_proj.weight, ...),
so a HF state dict loads with load_state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from .attention import TorchPagedAttention, make_attention_backend, triton_available
from .batch import ForwardBatch
from .config import ModelConfig
from .context import DEFAULT_DECODE_BUCKETS, ForwardContext, HostBatch, decode_bucket
from .graphs import DecodeGraphRunner, StaticStep
from .kv_pool import KVPool
from .layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rope
from .parallel import TPGroup
from .prefix_plan import PrefixShape


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, vocab] next-token logits after each request's last new token
    hidden: torch.Tensor  # [B, hidden] final-norm output of each request's last new token


@dataclass
class PreparedStep:
    """A forward whose host work is done (CausalLM.prepare): an eager context, or a decode
    step loaded into a graph runner's static buffers."""

    pool: KVPool
    backend: TorchPagedAttention
    context: ForwardContext | None = None
    static: StaticStep | None = None
    runner: DecodeGraphRunner | None = None
    # Tensor parallelism: what the engine's rank sends its workers when it runs this step.
    tp_payload: Any = None


class TPHooks(Protocol):
    """A tensor-parallel runtime on a model shard (tp_worker.TPDriver on the engine's rank):
    pools it makes and forwards it runs are mirrored on the worker ranks."""

    def pool_made(self, pool: KVPool) -> None: ...

    def prepared(self, hb: HostBatch, pool: KVPool, backend: str) -> Any: ...

    def executing(self, payload: Any) -> None: ...

    def fail(self, exc: BaseException) -> BaseException: ...


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
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.pool is not None
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if ctx.fused:
            from .fused import qk_norm_rope

            assert ctx.inv_freq is not None
            qw = self.q_norm.weight if self.qk_norm else None
            kw = self.k_norm.weight if self.qk_norm else None
            eps = self.q_norm.eps if self.qk_norm else 0.0
            q = qk_norm_rope(q, ctx.positions, ctx.inv_freq, qw, eps)
            k = qk_norm_rope(k, ctx.positions, ctx.inv_freq, kw, eps)
        else:
            assert ctx.cos is not None and ctx.sin is not None
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        # The store views include the scratch row that padding tokens write.
        k_cache, v_cache = ctx.pool.k_store[self.layer_idx], ctx.pool.v_store[self.layer_idx]
        # Write every new token's K/V first, so attention reads prefix and new tokens uniformly.
        k_cache.index_copy_(0, ctx.out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.out_slots, v.to(v_cache.dtype))
        o = ctx.backend.forward(q.to(k_cache.dtype), k_cache, v_cache, ctx, self.scale)
        out: torch.Tensor = self.o_proj(o.to(x.dtype).reshape(t, self.num_heads * self.head_dim))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SwiGLUMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out

    def forward_fused(
        self, h: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the residual adds carried into the next norm (one kernel each):
        takes (h, residual) with x = h + residual (residual None: x = h), returns the pair for
        the next layer."""
        from .fused import add_rmsnorm, silu_mul

        n1, n2, mlp = self.input_layernorm, self.post_attention_layernorm, self.mlp
        y, residual = add_rmsnorm(h, residual, n1.weight, n1.eps)
        y, residual = add_rmsnorm(self.self_attn(y, ctx), residual, n2.weight, n2.eps)
        out: torch.Tensor = mlp.down_proj(silu_mul(mlp.gate_proj(y), mlp.up_proj(y)))
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
    """Qwen3 / Llama causal LM over a paged KV pool.

    forward() takes one ragged ForwardBatch (prefill, extend and decode requests mixed) and
    returns next-token logits and final hidden states for each request's last new token.
    """

    def __init__(self, config: ModelConfig, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.attention_backend_name = attention_backend
        self._backends: dict[str, TorchPagedAttention] = {}
        # Decode speed switches (CUDA only): pad decode batches to a bucket; replay CUDA graphs.
        self.decode_padding: bool | None = None  # None: on when the model is on CUDA
        self.decode_graphs = True
        # Triton fusions of the elementwise chains (fused.py); None: on when on CUDA.
        self.fused: bool | None = None
        self.decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
        # Tensor parallelism (sharding.build_shard): this rank's group and the shapes it
        # computes (its heads and KV heads: its pool's and kernels' shapes); `tp` the runtime
        # that mirrors pools and forwards to worker ranks (on the engine's rank only).
        self.tp_group: TPGroup | None = None
        self.shard_config: ModelConfig = config
        self.tp: TPHooks | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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

    def pads_decode(self) -> bool:
        return (
            self.decode_padding if self.decode_padding is not None else self.device.type == "cuda"
        )

    def build_context(
        self,
        batch: ForwardBatch | HostBatch,
        pool: KVPool,
        backend: TorchPagedAttention,
        pad_rows_to: int | None = None,
    ) -> ForwardContext:
        """Host work of one forward (lengths, padding, the backend's host plan), one copy to the
        device. Nothing after this reads device memory back on the host."""
        shape = (
            PrefixShape.of(self.shard_config, pool.dtype.itemsize)
            if backend.shares_prefix
            else None
        )
        return ForwardContext.build(
            batch, self.device, pool.scratch_slot, backend.plan, pad_rows_to, shape
        )

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch | HostBatch,
        pool: KVPool,
        attention_backend: str | None = None,
        context: ForwardContext | None = None,
    ) -> ForwardOutput:
        """One ragged batch (prefill, extend and decode requests mixed) over the pool.

        Decode-only batches are padded to a bucket on CUDA (decode_padding) and replayed from a
        CUDA graph when decode_graphs is on; everything else runs eagerly. A prebuilt context
        (build_context) may be passed instead of being built here.
        """
        if context is not None:
            if self.tp is not None:  # the worker ranks would never see this forward
                raise RuntimeError("a tensor-parallel model runs forwards through prepare()")
            return self.forward_context(context, pool, self.attention(attention_backend))
        return self.execute(self.prepare(batch, pool, attention_backend))

    def prepare(
        self, batch: ForwardBatch | HostBatch, pool: KVPool, attention_backend: str | None = None
    ) -> PreparedStep:
        """A forward's host work (lengths, padding, prefix tables, the one copy to the device):
        what execute() then runs is device work only."""
        backend = self.attention(attention_backend)
        hb = batch if isinstance(batch, HostBatch) else HostBatch.from_batch(batch)
        if hb.deferred is not None and self.tp_group is not None and self.tp_group.world > 1:
            # The worker ranks would need the resolved tokens: a host sync on the engine's
            # rank, for a case that does not arise (the small model, which would take deferred
            # tokens, is never the tensor-parallel one). Refused rather than synced silently.
            raise ValueError(
                "DeferredTokens are not supported on a tensor-parallel model: resolve the "
                "tokens on the host (write them into token_ids) for its forwards"
            )
        step = self._prepare(hb, pool, backend)
        if self.tp is not None:  # after our own host work: its prefix groups travel too
            step.tp_payload = self.tp.prepared(hb, pool, backend.name)
        return step

    def _prepare(self, hb: HostBatch, pool: KVPool, backend: TorchPagedAttention) -> PreparedStep:
        pad_to = None
        if hb.is_decode and self.pads_decode():
            pad_to = decode_bucket(hb.num_requests, self.decode_buckets)
            runner = self.graph_runner(pool, backend) if self.decode_graphs else None
            if runner is not None and pad_to is not None and runner.fits(hb):
                return PreparedStep(pool, backend, static=runner.prepare(hb), runner=runner)
        return PreparedStep(pool, backend, context=self.build_context(hb, pool, backend, pad_to))

    def execute(self, step: PreparedStep) -> ForwardOutput:
        """A prepared forward's device work (graph replay or the eager body); under tensor
        parallelism its metadata goes to the worker ranks first, which run it alongside."""
        if step.tp_payload is None:
            return self._execute(step)
        assert self.tp is not None
        self.tp.executing(step.tp_payload)
        try:
            return self._execute(step)
        except Exception as exc:  # a collective failed: a worker rank is gone
            raise self.tp.fail(exc) from exc

    def _execute(self, step: PreparedStep) -> ForwardOutput:
        if step.runner is not None:
            assert step.static is not None
            return step.runner.execute(step.static)
        assert step.context is not None
        return self.forward_context(step.context, step.pool, step.backend)

    @torch.inference_mode()
    def forward_context(
        self, ctx: ForwardContext, pool: KVPool, backend: TorchPagedAttention
    ) -> ForwardOutput:
        """The forward body: device work only (no .item/.tolist/.cpu, no data-dependent shape),
        so it can be captured in a CUDA graph when the context's tensors are static buffers."""
        ctx.pool, ctx.backend = pool, backend
        ctx.attn = backend.prepare(ctx)
        x = self.model.embed_tokens(ctx.token_ids)
        ctx.fused = self.uses_fusions()
        if ctx.fused:
            ctx.inv_freq = self.rotary.inv_freq(x.device)
            residual = None
            for layer in self.model.layers:
                x, residual = cast(DecoderLayer, layer).forward_fused(x, residual, ctx)
            if residual is not None:
                x = x + residual
        else:
            ctx.cos, ctx.sin = self.rotary(ctx.positions, x.dtype)
            for layer in self.model.layers:
                x = layer(x, ctx)
        # Only each request's last token needs the final norm and the head. Padding rows go
        # through the head too (same GEMM shapes as the graph, hence the same rounding), then drop.
        hidden = self.model.norm(x.index_select(0, ctx.last_token))
        logits = self.lm_head(hidden).float()
        if ctx.num_real < ctx.num_requests:
            hidden, logits = hidden[: ctx.num_real], logits[: ctx.num_real]
        return ForwardOutput(logits=logits, hidden=hidden)

    def graph_runner(self, pool: KVPool, backend: TorchPagedAttention) -> DecodeGraphRunner | None:
        """The CUDA-graph decode runner of (pool, backend), made on first use; None when the
        model is not on CUDA. forward() uses it for decode steps while decode_graphs is on."""
        if self.device.type != "cuda":
            return None
        # Held by the pool, not the model: a dropped pool frees its graphs with it.
        key = (id(self), backend.name)
        runner = pool.graph_runners.get(key)
        if not isinstance(runner, DecodeGraphRunner) or runner.model is not self:
            runner = DecodeGraphRunner(self, pool, backend, self.decode_buckets)
            pool.graph_runners[key] = runner
        return runner
