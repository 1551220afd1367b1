"""The stubbed device (tokencache_models.testing.stubbed_device): zero logits at once, the host
preparation kept, the model's own (eager) or a GPU's (the Triton plan, decode steps padded into a
graph runner's buffers), on this CPU."""

from __future__ import annotations

import pytest
import torch

from tokencache_models import Epilogue, ForwardBatch, HostBatch, ModelConfig, random_model
from tokencache_models.executor.decode_graphs import DecodeGraphRunner
from tokencache_models.testing.stubbed_device import stub_execute

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def _decode(pool: object, rows: int) -> HostBatch:
    alloc = pool.alloc  # type: ignore[attr-defined]
    batch = ForwardBatch.from_requests(
        [[1]] * rows, [alloc(5) for _ in range(rows)], [alloc(1) for _ in range(rows)]
    )
    return HostBatch.from_batch(batch)


def test_a_stubbed_forward_returns_zeros_and_its_epilogue() -> None:
    for runner in ("eager", "gpu"):
        model = stub_execute(random_model(CONFIG, seed=1), runner)
        pool = model.make_kv_pool(64)
        step = model.prepare(_decode(pool, 3), pool, epilogue=Epilogue(CONFIG.vocab_size, True))
        assert (step.static is not None) is (runner == "gpu")  # the graph runner's buffers
        out = model.execute(step)
        assert out.logits.shape == (3, CONFIG.vocab_size) and not out.logits.any()
        assert out.greedy is not None and out.greedy.tolist() == [0, 0, 0]
        assert out.entropy is not None
        torch.testing.assert_close(out.entropy, torch.full((3,), torch.log(torch.tensor(64.0))))


def test_the_gpu_host_path_keeps_a_runner_per_pool() -> None:
    """prepare_runner makes the runner a decode step then takes; one per pool, by the pool
    itself: a later pool gets its own even when it reuses a dropped one's id()."""
    model = stub_execute(random_model(CONFIG, seed=2), "gpu")
    executor = model.executor
    pool = model.make_kv_pool(64)
    runner = executor.prepare_runner(pool)
    assert isinstance(runner, DecodeGraphRunner) and not runner.use_graphs
    assert executor.prepare_runner(pool) is runner
    torch_runner = executor.prepare_runner(pool, "torch")  # another backend: its own runner
    assert torch_runner is not None and torch_runner is not runner
    assert torch_runner.backend.name == "torch" and runner.backend.name == "triton"
    assert model.prepare(_decode(pool, 2), pool).runner is runner
    other = model.make_kv_pool(64)
    assert executor.prepare_runner(other) is not runner
    executor.decode_graphs = False  # graphs off: decode steps run eagerly, no runner
    assert executor.prepare_runner(pool) is None
    for _ in range(8):  # dropped pools: their runners go with them, none is handed on
        gone = model.make_kv_pool(32)
        executor.decode_graphs = True
        kept = executor.prepare_runner(gone)
        assert kept is not None and kept.pool is gone
        del gone, kept


def test_an_unknown_runner_is_refused() -> None:
    with pytest.raises(ValueError, match="runner must be one of"):
        stub_execute(random_model(CONFIG, seed=3), "cuda")
