"""Session fixtures: tiny random Qwen3 / Llama checkpoints saved once, and the SmolLM2 GGUF."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may download
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))  # run from a checkout without installing


@dataclass
class TinyCheckpoint:
    arch: str
    path: Path
    hf_model: Any  # transformers *ForCausalLM loaded back from `path`, fp32, eval


def _tiny_config(arch: str) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        # Wider init than the default so the greedy argmax has clear margins.
        "initializer_range": 0.08,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    }
    if arch == "qwen3":
        # Tied head, head_dim not hidden/heads, q/k norms: everything Qwen3-specific.
        return Qwen3Config(
            **common,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    # Separate head and llama3-style RoPE scaling with a short original context, so that scaling
    # actually changes frequencies at the tiny head_dim.
    return LlamaConfig(
        **common,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    arch: str = request.param
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return TinyCheckpoint(arch=arch, path=path, hf_model=hf)


@pytest.fixture(scope="session")
def smollm2() -> Any:
    from tokencache_models import load_smollm2_gguf

    return load_smollm2_gguf(dtype=torch.float32, keep_hf_model=True, attention_backend="torch")
