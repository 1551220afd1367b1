"""Decoder-only Qwen3 / Llama model whose layers read and write a paged KV pool.

Parameter names match the Hugging Face checkpoints (model.layers.N.self_attn.q_proj.weight, ...),
so a HF state dict loads with load_state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import AttentionMetadata, TorchPagedAttention, make_attention_backend
from .batch import ForwardBatch
from .config import ModelConfig
from .kv_pool import KVPool
from .layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rope


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, vocab] next-token logits after each request's last new token
    hidden: torch.Tensor  # [B, hidden] final-norm output of each request's last new token


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        pool: KVPool,
        backend: TorchPagedAttention,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = pool.k[self.layer_idx], pool.v[self.layer_idx]
        # Write every new token's K/V first, so attention reads prefix and new tokens uniformly.
        k_cache.index_copy_(0, out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, out_slots, v.to(v_cache.dtype))
        o = backend.forward(q.to(k_cache.dtype), k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.to(x.dtype).reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SwiGLUMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        pool: KVPool,
        backend: TorchPagedAttention,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, out_slots, pool, backend, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


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
        return KVPool.for_config(self.config, num_slots, self.device, dtype or self.dtype)

    def kv_pool_from_budget(self, budget_bytes: int, dtype: torch.dtype | None = None) -> KVPool:
        return KVPool.from_budget(self.config, budget_bytes, self.device, dtype or self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        attention_backend: str | None = None,
    ) -> ForwardOutput:
        device = self.device
        backend = make_attention_backend(attention_backend or self.attention_backend_name, device)
        batch = batch.to(device)
        meta = backend.prepare(batch, device)
        x = self.model.embed_tokens(batch.token_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch.out_slots, pool, backend, meta)
        # Only each request's last token needs the final norm and the head.
        last = (batch.q_offsets[1:] - 1).to(device)
        hidden = self.model.norm(x.index_select(0, last))
        logits = self.lm_head(hidden).float()
        return ForwardOutput(logits=logits, hidden=hidden)
