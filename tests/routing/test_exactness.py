"""Greedy routed output equals a no-cache reference that recomputes every token from scratch."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import bernoulli_decide, check, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    EntropyRouter,
    RoutedEngine,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.baselines.reference import decide_from_models
from tokencache_routing.core.launch_policy import LaunchPolicy
from tokencache_routing.core.scheduler_config import SchedulerConfig

DISPATCH = ["tokencache", "naive"]


@pytest.mark.parametrize("dispatch", DISPATCH)
@pytest.mark.parametrize(
    "script",
    [
        {0: [0], 1: [3], 2: [5, 6, 7]},
        {0: [1, 2, 3, 4], 1: [0, 8], 3: [9]},
        {1: list(range(0, 10, 2)), 2: list(range(1, 10, 3))},
    ],
)
def test_scripted_positions(pair: Any, dispatch: str, script: dict[int, list[int]]) -> None:
    router = ScriptedRouter(script)
    prompts = make_prompts(4, seed=len(script))
    check(pair, router, router.decide, prompts, 10, num_slots=512, dispatch=dispatch)


@pytest.mark.parametrize("launch", ["threshold", "cost"])
@pytest.mark.parametrize("dispatch", DISPATCH)
@pytest.mark.parametrize("p,seed", [(0.1, 0), (0.3, 1), (0.5, 2), (0.2, 7)])
def test_bernoulli(pair: Any, dispatch: str, p: float, seed: int, launch: LaunchPolicy) -> None:
    router = BernoulliRouter(p, seed=seed)
    prompts = make_prompts(5, seed=10 + seed)
    sched = SchedulerConfig(launch=launch)
    _, res = check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        12,
        num_slots=512,
        dispatch=dispatch,
        scheduler=sched,
    )
    # The large model prefills each token at most once: only what was written since its cursor.
    if dispatch == "tokencache":
        written = sum(len(p) + len(t) - 1 for p, t in zip(prompts, res.tokens, strict=True))
        assert sum(res.stats.catchup_tokens) <= written


@pytest.mark.parametrize("dispatch", DISPATCH)
def test_escalate_nothing_is_small_greedy(pair: Any, dispatch: str) -> None:
    prompts = make_prompts(4, seed=3)
    eng, res = check(
        pair, ScriptedRouter(), lambda r, p: False, prompts, 12, num_slots=256, dispatch=dispatch
    )
    assert res.stats.catchup_batch_sizes == []
    assert eng.large.tree.total_size() == 0  # the large model never ran


@pytest.mark.parametrize("dispatch", DISPATCH)
def test_escalate_everything_is_large_greedy(pair: Any, dispatch: str) -> None:
    prompts = make_prompts(4, seed=4)
    _, res = check(
        pair,
        ScriptedRouter(every=True),
        lambda r, p: True,
        prompts,
        12,
        num_slots=256,
        dispatch=dispatch,
    )
    assert all(m == [1] * 12 for m in res.models)


@pytest.mark.parametrize("dispatch", DISPATCH)
def test_shared_prefix_waves_and_delayed_batching(pair: Any, dispatch: str) -> None:
    router = BernoulliRouter(0.3, seed=5)
    prompts = make_prompts(9, seed=5, shared=24, lo=1, hi=6)
    # min_occupancy=0: catch-ups wait for their batch or their time, whatever the holes.
    sched = SchedulerConfig(max_running=4, min_large_batch=3, max_wait_steps=3, min_occupancy=0)
    eng, res = check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        10,
        num_slots=1024,
        dispatch=dispatch,
        scheduler=sched,
    )
    # The shared prefix is cached once in the small tree, not once per request.
    unshared = sum(len(p) + len(t) for p, t in zip(prompts, res.tokens, strict=True))
    assert eng.small.tree.total_size() <= unshared - 8 * 24
    if dispatch == "tokencache":
        assert max(res.stats.catchup_batch_sizes) > 1


@pytest.mark.parametrize("dispatch", DISPATCH)
def test_identical_prompts_dedup(pair: Any, dispatch: str) -> None:
    router = ScriptedRouter({0: [2, 5], 1: [2, 5], 2: [3]})
    prompts = [make_prompts(1, seed=6)[0]] * 3
    check(pair, router, router.decide, prompts, 8, num_slots=256, dispatch=dispatch)


@pytest.mark.parametrize("dispatch", DISPATCH)
def test_tiny_pool_evicts_and_preempts(pair: Any, dispatch: str) -> None:
    router = BernoulliRouter(0.25, seed=8)
    prompts = make_prompts(6, seed=8, shared=6, lo=4, hi=8)
    eng, res = check(
        pair, router, bernoulli_decide(router), prompts, 14, num_slots=48, dispatch=dispatch
    )
    assert res.stats.preemptions > 0
    # A second call on the warm (full) trees must evict cached KV and stay exact.
    res2 = eng.generate(prompts[:3], 6)
    ref, _ = reference_generate(*pair, prompts[:3], 6, bernoulli_decide(router))
    assert res2.tokens == ref
    assert eng.idle_invariant()


@pytest.mark.parametrize("dispatch", DISPATCH)
def test_entropy_router_recorded_decisions(pair: Any, dispatch: str) -> None:
    small, large = pair
    prompts = make_prompts(5, seed=9)
    eng = RoutedEngine(
        small, large, EntropyRouter(3.5), config=EngineConfig(num_slots=512, dispatch=dispatch)
    )
    res = eng.generate(prompts, 12)
    ref, _ = reference_generate(small, large, prompts, 12, decide_from_models(res.models))
    assert res.tokens == ref
    assert 0 < sum(map(sum, res.models)) < sum(map(len, res.models))  # really mixed


def test_naive_equals_tokencache_and_stream(pair: Any) -> None:
    small, large = pair
    router = BernoulliRouter(0.2, seed=11)
    prompts = make_prompts(7, seed=11, shared=10)
    sched = SchedulerConfig(max_running=3, min_large_batch=2, max_wait_steps=2)
    out = {}
    for dispatch in DISPATCH:
        eng = RoutedEngine(
            small,
            large,
            router,
            config=EngineConfig(num_slots=512, dispatch=dispatch, scheduler=sched),
        )
        out[dispatch] = eng.generate(prompts, 9)
    assert out["naive"].tokens == out["tokencache"].tokens
    assert out["naive"].models == out["tokencache"].models
    eng = RoutedEngine(small, large, router, config=EngineConfig(num_slots=512, scheduler=sched))
    tokens: list[list[int]] = [[] for _ in prompts]
    models: list[list[int]] = [[] for _ in prompts]
    for rid, tok, model in eng.stream(prompts, 9):
        tokens[rid].append(tok)
        models[rid].append(model)
    assert tokens == out["tokencache"].tokens and models == out["tokencache"].models


@pytest.mark.parametrize("dispatch", DISPATCH)
def test_eos_stops_a_request(pair: Any, dispatch: str) -> None:
    small, large = pair
    router = BernoulliRouter(0.3, seed=12)
    prompts = make_prompts(4, seed=12)
    free_run, _ = reference_generate(small, large, prompts, 10, bernoulli_decide(router))
    eos = free_run[0][4]  # a token that really occurs
    eng = RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(num_slots=256, dispatch=dispatch, eos_token_id=eos),
    )
    res = eng.generate(prompts, 10)
    ref, _ = reference_generate(small, large, prompts, 10, bernoulli_decide(router), eos)
    assert res.tokens == ref
    assert len(res.tokens[0]) <= 5
    assert eng.idle_invariant()


@pytest.mark.parametrize("cost", [2.0, 5.0])
@pytest.mark.parametrize("num_slots", [512, 56])
def test_slow_large_model_no_barrier(pair: Any, cost: float, num_slots: int) -> None:
    """A catch-up takes `cost` small steps: the small model keeps decoding the other requests,
    the returning requests rejoin later, and tokens stay exact (also under memory pressure)."""
    router = BernoulliRouter(0.25, seed=13)
    prompts = make_prompts(6, seed=13, shared=6, lo=3, hi=8)
    sched = SchedulerConfig(max_running=6, min_large_batch=2, max_wait_steps=2, min_occupancy=0)
    kw = {"num_slots": num_slots, "scheduler": sched, "large_step_cost": cost}
    kw["topology"] = "two-devices"
    _, fast = check(pair, router, bernoulli_decide(router), prompts, 14, **kw)
    _, naive = check(pair, router, bernoulli_decide(router), prompts, 14, dispatch="naive", **kw)
    # Modelled on the step clock (no wall time): without a barrier the small model waits less.
    assert fast.stats.small_idle_s < naive.stats.small_idle_s
    assert fast.stats.modeled_s < naive.stats.modeled_s


@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize("clock", ["steps", "measured", "gpu"])
@pytest.mark.parametrize("overlap", [True, False])
def test_cost_launch_policy_is_exact(pair: Any, mode: str, clock: str, overlap: bool) -> None:
    """SchedulerConfig(launch="cost") on every clock's prices (the step clock's constants,
    measured forward times, the GPU clock's model), both drivers: catch-ups wait for bigger
    batches and the tokens stay the reference's, under memory pressure too."""
    router = BernoulliRouter(0.2, seed=41)
    prompts = make_prompts(10, seed=41, shared=6, lo=2, hi=8)
    sched = SchedulerConfig(max_running=6, max_parked=2, launch="cost")
    for num_slots in (1024, 64):
        _, res = check(
            pair,
            router,
            bernoulli_decide(router),
            prompts,
            14,
            num_slots=num_slots,
            scheduler=sched,
            clock=clock,
            mode=mode,
            overlap=overlap,
        )
        if mode == "events" and clock != "measured":
            assert max(res.stats.catchup_batch_sizes) > 1  # it waited for bigger catch-ups


@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("p,seed", [(0.1, 3), (0.4, 4)])
def test_graphed_paths_route_exactly(
    graphed_pair: Any, mode: str, page_size: int, p: float, seed: int
) -> None:
    """Every decode step and catch-up through the graph runners' static paths (what a CUDA
    graph replays): the routed output still equals the no-cache reference, prompts sharing a
    prefix included, and no multi-token forward of the large model ran eagerly."""
    router = BernoulliRouter(p, seed=seed)
    prompts = make_prompts(5, seed=20 + seed, shared=6)
    _, res = check(
        graphed_pair,
        router,
        bernoulli_decide(router),
        prompts,
        12,
        num_slots=512,
        page_size=page_size,
        mode=mode,
    )
    paths = res.stats.forward_paths
    assert paths.get("large extend static", 0) >= 1, paths
    assert "large extend eager" not in paths and "small decode eager" not in paths, paths
    assert res.stats.graph_share() == 1.0
