"""RoutedEngine.warm_up: every graph key the engine's forwards use is made before serving, so
a warmed-up engine captures and compiles nothing while it serves (on CPU: the runners' static
paths, whose keys are what CUDA graphs are captured for; a forward outside them counts as a
cold run)."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import bernoulli_decide, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    EntropyRouter,
    RoutedEngine,
    reference_generate,
)
from tokencache_routing.core.scheduler_config import SchedulerConfig

# Small limits keep the warm-up's keys (and the torch path's static shapes) small on the CPU.
LIMITS = SchedulerConfig(max_running=4, max_parked=4, chunked_prefill_size=64)


def _engine(pair: Any, router: Any, mode: str) -> RoutedEngine:
    return RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, scheduler=LIMITS, mode=mode)
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_after_warm_up_serving_makes_no_graph(graphed_pair: Any, mode: str) -> None:
    router = BernoulliRouter(0.3, seed=5)
    eng = _engine(graphed_pair, router, mode)
    done = eng.warm_up()
    assert done.keys > 0 and done.seconds > 0
    reserved = [side.table.generation for side in eng.sides]
    prompts = make_prompts(10, seed=3, shared=12, hi=30)  # more than max_admitted, chunked
    res = eng.generate(prompts, 16)
    ref, _ = reference_generate(*graphed_pair, prompts, 16, bernoulli_decide(router))
    assert res.tokens == ref
    assert eng.cold_runs() == 0, res.stats.forward_paths
    assert res.stats.graph_share() == 1.0, res.stats.forward_paths
    assert [side.table.generation for side in eng.sides] == reserved  # never moved again
    eng.shutdown()


@pytest.mark.timeout(300)
def test_a_forward_outside_the_warm_keys_is_counted(graphed_pair: Any) -> None:
    """The counter can fail: a router whose answer the forward computes (an entropy
    threshold) asks for another epilogue than the one warmed up, so its steps are cold."""
    eng = _engine(graphed_pair, BernoulliRouter(0.3, seed=5), "events")
    eng.warm_up()
    eng.router = EntropyRouter(threshold=1.0)
    eng.generate(make_prompts(3, seed=4), 6)
    assert eng.cold_runs() > 0
    eng.shutdown()


def test_reserve_moves_a_table_once_and_keeps_its_rows() -> None:
    import numpy as np

    from tokencache_models.kv.slot_table import SlotTable

    table = SlotTable(2, 4, 99, "cpu", max_width=64)
    row = table.acquire()
    table.write(row, 0, np.array([5, 6, 7]))
    table.reserve(10, 1000)  # the width capped at max_width
    assert (table.rows, table.width, table.generation) == (10, 64, 2)
    assert table.row(row, 3).tolist() == [5, 6, 7]
    table.reserve(3, 8)  # already that large: no move
    assert table.generation == 2
    assert [table.acquire() for _ in range(9)]  # the reserved rows are free rows


def test_without_runners_warm_up_makes_nothing(pair: Any) -> None:
    """CPU models with their executors' defaults have no graph runners: nothing to warm."""
    eng = _engine(pair, BernoulliRouter(0.3, seed=5), "events")
    assert eng.warm_up().keys == 0 and eng.cold_runs() == 0
