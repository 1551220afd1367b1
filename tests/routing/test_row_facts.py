"""What a request keeps while it runs reaches the router and the sampler as arrays carried from
step to step (core/batch.py RowFacts): through the engine, with overlap and without, steps that
admit new requests beside continued rows included, the router sees each row's own route key and
generated position as int64 tensors, and a request's sampling switch follows it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from routing_helpers import check_idle, make_prompts

from tokencache_routing import (
    EngineConfig,
    RoutedEngine,
    SamplingParams,
    SchedulerConfig,
    reference_generate,
)
from tokencache_routing.core.routers import Router, RouterFeatures


class Recorder(Router):
    """Escalates nothing; records (route key, generated position) per row and the dtypes."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []
        self.dtypes: set[tuple[torch.dtype, torch.dtype]] = set()

    def route(self, f: RouterFeatures) -> torch.Tensor:
        self.dtypes.add((f.rids.dtype, f.positions.dtype))
        self.seen += list(zip(f.rids.tolist(), f.positions.tolist(), strict=True))
        return torch.zeros(len(f.rids), dtype=torch.bool)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_router_sees_each_rows_own_key_and_generated_position(
    pair: Any, overlap: bool, mode: str
) -> None:
    # Prompts of different lengths, more requests than places: later steps admit new
    # requests beside rows continued from the step before (mixed steps).
    prompts = make_prompts(7, seed=91, shared=4, lo=2, hi=9)
    new = [5, 9, 3, 7, 6, 4, 8]
    router = Recorder()
    eng = RoutedEngine(
        *pair,
        router,
        config=EngineConfig(
            num_slots=512, mode=mode, overlap=overlap, scheduler=SchedulerConfig(max_running=3)
        ),
    )
    keys = [100 + 7 * i for i in range(len(prompts))]
    handles = [eng.submit(p, n, route_key=k) for p, n, k in zip(prompts, new, keys, strict=True)]
    assert all(h.wait(60) for h in handles)
    eng.shutdown()
    assert router.dtypes == {(torch.int64, torch.int64)}
    # each request's every generated position once, under its own key (overlap drops no row
    # here: nothing is parked or stopped early)
    expect = sorted((k, pos) for k, n in zip(keys, new, strict=True) for pos in range(n))
    assert sorted(router.seen) == expect
    ref, _ = reference_generate(*pair, prompts, max(new), lambda rid, pos: False)
    assert [h.tokens for h in handles] == [t[:n] for t, n in zip(ref, new, strict=True)]
    check_idle(eng)


def test_a_sampled_request_keeps_sampling_beside_greedy_ones(pair: Any) -> None:
    """Rows are sampled or argmax'ed by their own request's settings whichever step carried
    them: a sampled request draws what it draws alone, greedy ones equal the reference."""
    prompts = make_prompts(4, seed=92, shared=3, lo=3, hi=6)
    hot = SamplingParams(1.5, seed=11)
    eng = RoutedEngine(
        *pair,
        Recorder(),
        config=EngineConfig(num_slots=512, scheduler=SchedulerConfig(max_running=2)),
    )
    handles = [eng.submit(p, 8, sampling=hot if i == 2 else None) for i, p in enumerate(prompts)]
    assert all(h.wait(60) for h in handles)
    alone = RoutedEngine(*pair, Recorder(), config=EngineConfig(num_slots=512))
    solo = alone.submit(prompts[2], 8, sampling=hot)
    assert solo.wait(60)
    assert handles[2].tokens == solo.tokens
    greedy = [p for i, p in enumerate(prompts) if i != 2]
    ref, _ = reference_generate(*pair, greedy, 8, lambda rid, pos: False)
    assert [h.tokens for i, h in enumerate(handles) if i != 2] == ref
    check_idle(eng)
