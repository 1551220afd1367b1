"""Random-weight models, backend selection, and batch validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokencache_models import (
    QWEN3_0_6B,
    ForwardBatch,
    TorchPagedAttention,
    make_attention_backend,
    random_model,
)


def test_random_model_runs_and_is_deterministic() -> None:
    cfg = dataclasses.replace(
        QWEN3_0_6B,
        vocab_size=500,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    a = random_model(cfg, dtype=torch.bfloat16, seed=3, attention_backend="auto")
    b = random_model(cfg, dtype=torch.bfloat16, seed=3)
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied preset
    assert a.model.layers[0].self_attn.q_norm.weight.eq(1).all()
    pool = a.kv_pool_from_budget(64 * 1024)
    assert pool.dtype == torch.bfloat16 and pool.num_slots == 64 * 1024 // (2 * 2 * 2 * 16 * 2)
    batch = ForwardBatch.from_requests([[1, 2, 3], [4]], [[], []], [pool.alloc(3), pool.alloc(1)])
    out_a = a(batch, pool)
    out_b = b(batch, pool)
    assert torch.equal(out_a.logits, out_b.logits) and out_a.hidden.dtype == torch.bfloat16
    assert torch.isfinite(out_a.logits).all()


def test_backend_selection_on_cpu() -> None:
    assert isinstance(make_attention_backend("auto", "cpu"), TorchPagedAttention)
    assert make_attention_backend("auto", "cpu").name == "torch"
    assert make_attention_backend("triton", "cpu").name == "triton"  # importable, GPU-only use
    with pytest.raises(ValueError):
        make_attention_backend("nope", "cpu")


def test_batch_validation_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError):
        ForwardBatch.from_requests([[1, 2]], [[0]], [[5]])  # 2 tokens, 1 slot
    good = ForwardBatch.from_requests([[1, 2]], [[0]], [[5, 6]])
    assert good.positions.tolist() == [1, 2]
    bad = dataclasses.replace(good, kv_slots=torch.tensor([0, 6, 5]))
    with pytest.raises(ValueError):
        bad.validate()
