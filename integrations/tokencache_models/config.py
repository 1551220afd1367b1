"""Model configuration for the paged-KV runner (Qwen3, Qwen2 and Llama decoder-only models)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedConfigError(ValueError):
    """A config field whose value the runner does not implement; `field` names it.

    Raised instead of building a model that would silently compute something else."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"{field}={value!r} is not supported: {why}")
        self.field = field
        self.value = value


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer; mirrors the Hugging Face config fields."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF rope scaling dict ("rope_type": "default" | "linear" | "llama3", ...); None means default.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Also guards configs built directly (presets, tests), not only from_hf_dict.
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                "model_type", self.model_type, f"expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.attention_bias:
            # HF's attention_bias (Llama, Qwen3) puts a bias on o_proj too; only Qwen2's
            # q/k/v bias is implemented (qkv_bias).
            raise UnsupportedConfigError(
                "attention_bias", True, "only Qwen2's q/k/v biases are implemented"
            )

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before RoPE; Qwen2 and Llama do not."""
        return self.model_type == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has biases on q_proj, k_proj and v_proj (none on o_proj or the MLP);
        transformers' Qwen2Attention hard-codes them, its config has no field for it."""
        return self.model_type == "qwen2"

    @property
    def kv_elems_per_token(self) -> int:
        """Elements of K plus V for one token across all layers (times itemsize = bytes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def truncated(self, num_layers: int) -> ModelConfig:
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ValueError(
                f"num_layers must be in [1, {self.num_hidden_layers}], got {num_layers}"
            )
        return replace(self, num_hidden_layers=num_layers)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a config.json / PretrainedConfig.to_dict(); raises UnsupportedConfigError for
        any field whose value would make transformers compute something this runner does not."""
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                "model_type", model_type, f"expected one of {SUPPORTED_MODEL_TYPES}"
            )
        _refuse_unsupported(model_type, d)
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        # transformers >= 5 writes "rope_parameters" (theta included); older files use
        # "rope_theta" + "rope_scaling".
        rope = d.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = d.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        rope_type = (
            scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedConfigError(
                "rope_scaling.rope_type", rope_type, f"expected one of {SUPPORTED_ROPE_TYPES}"
            )
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if rope_type != "default" else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            eos_token_id=d.get("eos_token_id"),
            extra=d,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


def _refuse_unsupported(model_type: str, d: dict[str, Any]) -> None:
    """The HF fields that change the computation and that this runner does not implement."""
    # Qwen2 ignores attention_bias (its q/k/v biases are always on, o_proj has none).
    if model_type != "qwen2" and d.get("attention_bias"):
        raise UnsupportedConfigError(
            "attention_bias", d["attention_bias"], "only Qwen2's q/k/v biases are implemented"
        )
    if d.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias", d["mlp_bias"], "the MLP has no biases")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfigError("hidden_act", act, "the MLP is SwiGLU (silu)")
    # Qwen2 / Qwen3: sliding-window attention on layers >= max_window_layers; the attention
    # backends attend over every slot of a request, so a sliding layer would be wrong.
    if d.get("use_sliding_window"):
        raise UnsupportedConfigError(
            "use_sliding_window", d["use_sliding_window"], "attention is over the whole context"
        )
    sliding = [t for t in d.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise UnsupportedConfigError(
            "layer_types", sorted(set(sliding)), "every layer must be full_attention"
        )


def _qwen3(layers: int, hidden: int, inter: int, heads: int, tie: bool) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tie,
        max_position_embeddings=40960,
        eos_token_id=151645,
    )


# Shapes of the public Qwen3 checkpoints (from their config.json), for random-weight benchmarks.
QWEN3_0_6B = _qwen3(layers=28, hidden=1024, inter=3072, heads=16, tie=True)
QWEN3_8B = _qwen3(layers=36, hidden=4096, inter=12288, heads=32, tie=False)
QWEN3_32B = _qwen3(layers=64, hidden=5120, inter=25600, heads=64, tie=False)


def _llama3(
    layers: int, hidden: int, inter: int, head_dim: int, factor: float, tie: bool
) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=tie,
        max_position_embeddings=131072,
        eos_token_id=128001,
    )


# Llama 3.2 1B and 3.1 8B share a tokenizer: a routing pair whose small model's KV per token
# (16 layers x 8 x 64: 32 KiB in bf16) is a quarter of the large one's, where Qwen3-0.6B's
# (112 KiB) is nearly Qwen3-8B's (144 KiB).
LLAMA_3_2_1B = _llama3(layers=16, hidden=2048, inter=8192, head_dim=64, factor=32.0, tie=True)
LLAMA_3_1_8B = _llama3(layers=32, hidden=4096, inter=14336, head_dim=128, factor=8.0, tie=False)


def _r1_distill_qwen(
    layers: int,
    hidden: int,
    inter: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    theta: float,
    eps: float,
) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=eps,
        rope_theta=theta,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        eos_token_id=151643,
    )


# DeepSeek-R1-Distill-Qwen-1.5B / -32B (Qwen2 architecture; from their config.json): R2R's
# routing pair. Both untied; their vocabularies differ in padding only (151936 vs 152064 rows
# over one tokenizer), so a pair of them needs the engine to route over the shared ids.
R1_DISTILL_QWEN_1_5B = _r1_distill_qwen(
    layers=28,
    hidden=1536,
    inter=8960,
    heads=12,
    kv_heads=2,
    vocab=151936,
    theta=10000.0,
    eps=1e-6,
)
R1_DISTILL_QWEN_32B = _r1_distill_qwen(
    layers=64,
    hidden=5120,
    inter=27648,
    heads=40,
    kv_heads=8,
    vocab=152064,
    theta=1_000_000.0,
    eps=1e-5,
)

PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-8b": QWEN3_8B,
    "qwen3-32b": QWEN3_32B,
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3.1-8b": LLAMA_3_1_8B,
    "r1-distill-qwen-1.5b": R1_DISTILL_QWEN_1_5B,
    "r1-distill-qwen-32b": R1_DISTILL_QWEN_32B,
}
