"""Shared helpers of the routing tests (a unique module name: tests/*/conftest.py collide)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96


def tiny_config(layers: int) -> Any:
    from tokencache_models import ModelConfig

    # Untied head and a wide init: varied greedy outputs with clear argmax margins.
    return ModelConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )


def make_prompts(n: int, seed: int, shared: int = 0, lo: int = 2, hi: int = 10) -> list[list[int]]:
    """n prompts; with shared > 0 they all start with the same `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (shared,), generator=g).tolist()
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(base + torch.randint(0, VOCAB, (k,), generator=g).tolist())
    return out
