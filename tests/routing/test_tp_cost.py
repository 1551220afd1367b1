"""tp_cost: the GPU clock's price of a tensor-parallel forward (per-rank roofline + collectives)."""

from __future__ import annotations

import pytest

from tokencache_routing.sim.clock import GpuClock, Roofline
from tokencache_routing.sim.tp_cost import (
    COLLECTIVE_LATENCY_S,
    NVLINK_BYTES_S,
    TPRoofline,
    tp_clock,
    tp_forward_cost,
)

SHAPES = [(1, 32, 32 * 4096), (32, 32, 32 * 4096), (8, 2048, 8 * 4096), (1, 8192, 8192)]


@pytest.mark.parametrize("batch,new,kv", SHAPES)
def test_tp1_is_the_roofline(batch: int, new: int, kv: int) -> None:
    assert TPRoofline.of_tp("qwen3-32b", 1)(batch, new, kv) == Roofline.of("qwen3-32b")(
        batch, new, kv
    )


def test_tp2_splits_the_work_and_adds_the_collectives() -> None:
    one, two = Roofline.of("qwen3-32b"), TPRoofline.of_tp("qwen3-32b", 2)
    assert two.weight_bytes == one.weight_bytes / 2
    assert two.kv_bytes_per_token == one.kv_bytes_per_token / 2
    # Decode at batch 32: 129 all-reduces of 32 x 5120 bf16 and a 32 x vocab all-gather.
    act = 32 * 5120 * 2
    comm = 129 * (COLLECTIVE_LATENCY_S + act / NVLINK_BYTES_S) + (
        COLLECTIVE_LATENCY_S + 0.5 * 32 * 151936 * 2 / NVLINK_BYTES_S
    )
    assert two.collectives_s(32, 32) == pytest.approx(comm)
    t1, t2 = one(32, 32, 32 * 4096), two(32, 32, 32 * 4096)
    assert t2 == pytest.approx(t1 / 2 + comm)
    assert t1 / 2 < t2 < t1  # faster than one GPU, slower than half of it
    # A long prefill moves 8191 more tokens' activations through each of the 129 all-reduces.
    more = two.collectives_s(1, 8192) - two.collectives_s(1, 1)
    assert more == pytest.approx(129 * 8191 * 5120 * 2 / NVLINK_BYTES_S)


@pytest.mark.parametrize("batch,new,kv", SHAPES)
def test_floor_stays_a_lower_bound(batch: int, new: int, kv: int) -> None:
    cost = tp_forward_cost("qwen3-32b", 2)
    assert cost.floor(new, kv) <= cost(batch, new, kv) + 1e-12


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    one = Roofline.of("r1-distill-qwen-1.5b")  # 2 KV heads
    four = TPRoofline.of_tp("r1-distill-qwen-1.5b", 4)  # each rank a copy of one of them
    assert four.kv_bytes_per_token == one.kv_bytes_per_token / 2
    assert four.weight_bytes == one.weight_bytes / 4


def test_refuses_shapes_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        TPRoofline.of_tp("r1-distill-qwen-1.5b", 8)  # 12 heads
    with pytest.raises(ValueError, match="tp must be"):
        TPRoofline.of_tp("qwen3-32b", 0)


def test_tp_clock_prices_only_the_large_model_split() -> None:
    base = GpuClock("qwen3-0.6b", "qwen3-32b", "h200-roofline")
    clock = tp_clock("qwen3-0.6b", "qwen3-32b", 2)
    args = (32, 32, 32 * 2048)
    assert clock.forward_s(0, *args) == base.forward_s(0, *args)
    assert clock.forward_s(1, *args) < base.forward_s(1, *args)
    assert "tp=2" in clock.describe()
    same = tp_clock("qwen3-0.6b", "qwen3-32b", 1)
    assert same.forward_s(1, *args) == base.forward_s(1, *args)
