"""Placement and KV-pool sizing of `tokencache serve`: --small-device / --large-device reach the
engine, the pools come from a GPU's memory by --mem-fraction-static (with the device's memory
given by a stand-in here), a pair that does not fit is refused with the numbers, and the CPU
keeps its defaults."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokencache_serve.cli import CPU_SLOTS, build_app, build_parser, pool_sizes
from tokencache_serve.placement import MIN_SLOTS, PoolNeed, kv_slots

GIB = 1 << 30
GPU0, GPU1 = torch.device("cuda:0"), torch.device("cuda:1")


def memory(table: dict[torch.device, tuple[int, int]]) -> Any:
    return lambda device: table[device]


def test_one_device_shares_its_budget_in_equal_slot_counts() -> None:
    needs = [PoolNeed("small", GPU0, 100), PoolNeed("large", GPU0, 300)]
    slots = kv_slots(needs, 0.5, memory({GPU0: (100 * GIB, 20 * GIB)}))
    budget = 50 * GIB - 20 * GIB
    assert slots == {"small": budget // 400, "large": budget // 400}


def test_two_devices_each_pool_takes_its_own_budget() -> None:
    needs = [PoolNeed("small", GPU0, 100), PoolNeed("large", GPU1, 300)]
    mem = memory({GPU0: (80 * GIB, 2 * GIB), GPU1: (80 * GIB, 60 * GIB)})
    slots = kv_slots(needs, 0.9, mem)
    assert slots["small"] == (int(0.9 * 80 * GIB) - 2 * GIB) // 100
    assert slots["large"] == (int(0.9 * 80 * GIB) - 60 * GIB) // 300


def test_a_pair_that_does_not_fit_is_refused_with_its_numbers() -> None:
    needs = [PoolNeed("small", GPU0, 100), PoolNeed("large", GPU0, 300_000)]
    with pytest.raises(ValueError) as e:
        kv_slots(needs, 0.85, memory({GPU0: (140 * GIB, 118 * GIB)}))
    text = str(e.value)
    assert "cuda:0" in text and "small and large" in text
    assert "0.85 x 140.0 GiB" in text and "118.0 GiB" in text and f"at least {MIN_SLOTS}" in text
    # Just enough for MIN_SLOTS passes.
    exact = 118 * GIB + MIN_SLOTS * 300_100
    ok = kv_slots(needs, 1.0, memory({GPU0: (exact, 118 * GIB)}))
    assert ok == {"small": MIN_SLOTS, "large": MIN_SLOTS}
    with pytest.raises(ValueError, match="mem-fraction-static"):
        kv_slots(needs, 1.5, memory({GPU0: (exact, 0)}))


def _args(*flags: str) -> Any:
    return build_parser().parse_args(["serve", "--large", "tiny", *flags])


def test_pool_sizes_on_the_cpu_and_given_ones() -> None:
    small = large = torch.nn.Module()
    cpu = torch.device("cpu")
    assert pool_sizes(_args(), small, large, cpu, cpu) == (CPU_SLOTS, None)
    given = _args("--num-slots", "100", "--large-num-slots", "50")
    assert pool_sizes(given, small, large, cpu, cpu) == (100, 50)


def test_devices_reach_the_engine() -> None:
    app = build_app(_args("--num-slots", "1024", "--small-device", "cpu", "--large-device", "cpu"))
    engine = app.state.server.engine
    assert [side.model.device.type for side in engine.sides] == ["cpu", "cpu"]
    assert [side.pool.num_slots for side in engine.sides] == [1024, 1024]
    assert engine.topology == "one-device"
