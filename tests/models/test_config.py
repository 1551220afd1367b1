"""Config parsing (old and new HF RoPE layouts) and RoPE frequencies against transformers."""

from __future__ import annotations

import pytest
import torch

from tokencache_models import PRESETS, ModelConfig
from tokencache_models.layers import rope_inv_freq

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_old_and_new_rope_layouts_agree() -> None:
    old = ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": LLAMA3})
    new = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert old == new
    assert old.head_dim == 16 and old.num_key_value_heads == 4 and old.rope_theta == 5e5


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "model_type"},
        rope_parameters={**LLAMA3, "rope_theta": 5e5},
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
    ours = rope_inv_freq(ModelConfig.from_hf_dict(hf_cfg.to_dict()))
    assert torch.equal(ours, ref)


def test_unsupported_inputs_raise() -> None:
    with pytest.raises(ValueError):
        ModelConfig.from_hf_dict({**BASE, "model_type": "mistral"})
    with pytest.raises(ValueError):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_presets_have_qwen3_shapes() -> None:
    assert PRESETS["qwen3-8b"].num_hidden_layers == 36 and PRESETS["qwen3-8b"].hidden_size == 4096
    assert (
        PRESETS["qwen3-0.6b"].tie_word_embeddings and not PRESETS["qwen3-32b"].tie_word_embeddings
    )
    qwen3 = [c for name, c in PRESETS.items() if name.startswith("qwen3")]
    assert len(qwen3) == 3 and all(c.qk_norm and c.head_dim == 128 for c in qwen3)


@pytest.mark.parametrize(
    "name,params", [("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248)]
)
def test_llama3_presets_have_the_published_parameter_counts(name: str, params: int) -> None:
    """Built on the meta device (no memory): every matrix and the embedding tie are right."""
    from tokencache_models import CausalLM

    config = PRESETS[name]
    with torch.device("meta"):
        model = CausalLM(config, "torch")
    model.tie_weights()
    assert sum(p.numel() for p in model.parameters()) == params  # shared tensors counted once
    assert not config.qk_norm and config.rope_scaling is not None
