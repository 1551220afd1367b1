"""Slot allocator accounting and pool sizing."""

from __future__ import annotations

import pytest
import torch

from tokencache_models import KVPool, ModelConfig, SlotAllocator


def _cfg() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    )


def test_alloc_free_exact_accounting() -> None:
    a = SlotAllocator(10)
    s1 = a.alloc(4)
    s2 = a.alloc(6)
    assert s1.dtype == torch.int64 and a.available == 0 and a.used == 10
    assert sorted(torch.cat((s1, s2)).tolist()) == list(range(10))
    with pytest.raises(MemoryError):
        a.alloc(1)
    a.free(s1[1:3])
    assert a.available == 2
    s3 = a.alloc(2)
    assert sorted(s3.tolist()) == sorted(s1[1:3].tolist())
    assert a.alloc(0).numel() == 0


def test_double_free_and_bad_free_raise() -> None:
    a = SlotAllocator(8)
    s = a.alloc(3)
    a.free(s[:1])
    with pytest.raises(ValueError):
        a.free(s[:1])
    with pytest.raises(ValueError):
        a.free(torch.tensor([7]))  # never allocated
    with pytest.raises(ValueError):
        a.free(torch.tensor([s[1].item(), s[1].item()]))  # duplicate in one call
    with pytest.raises(ValueError):
        a.free(torch.tensor([8]))
    assert a.available == 6  # failed frees changed nothing
    a.free(s[1:])
    assert a.available == 8


def test_pool_from_budget() -> None:
    cfg = _cfg()
    per_slot = 2 * 3 * 1 * 4 * 2  # K+V, layers, kv heads, head_dim, bf16 bytes
    assert KVPool.bytes_per_slot(cfg, torch.bfloat16) == per_slot
    pool = KVPool.from_budget(cfg, per_slot * 100 + per_slot - 1, "cpu", torch.bfloat16)
    assert pool.num_slots == 100 and pool.available == 100
    assert pool.k.shape == (3, 100, 1, 4) and pool.v.dtype == torch.bfloat16
    assert pool.nbytes <= per_slot * 100 + per_slot - 1
    with pytest.raises(ValueError):
        KVPool.from_budget(cfg, per_slot - 1)
