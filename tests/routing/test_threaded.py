"""mode="threaded": one worker thread per model. Router decisions are functions of (request,
position), so thread timing changes batches, never tokens: output equals the no-cache reference."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import bernoulli_decide, check, make_prompts, no_worker_threads

from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine, Router, ScriptedRouter
from tokencache_routing.core.launch_policy import LaunchPolicy
from tokencache_routing.core.scheduler_config import SchedulerConfig


@pytest.mark.parametrize("launch", ["threshold", "cost"])
@pytest.mark.parametrize("p,seed", [(0.1, 0), (0.3, 1), (0.5, 2), (0.2, 3)])
@pytest.mark.parametrize("num_slots", [1024, 56])
def test_threaded_bernoulli(
    pair: Any, p: float, seed: int, num_slots: int, launch: LaunchPolicy
) -> None:
    router = BernoulliRouter(p, seed=seed)
    prompts = make_prompts(7, seed=30 + seed, shared=8, lo=2, hi=7)
    # launch="cost": no wait cap, the step clock's prices (a hole 1/5 of a step, a catch-up 1)
    wait = 0.002 if launch == "threshold" else 0.0
    sched = SchedulerConfig(
        max_running=5,
        min_large_batch=3,
        max_wait_s=wait,
        launch=launch,
    )
    check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        12,
        num_slots=num_slots,
        scheduler=sched,
        mode="threaded",
    )
    assert no_worker_threads()


def test_threaded_tiny_pool_preempts_and_warm_trees(pair: Any) -> None:
    router = BernoulliRouter(0.25, seed=8)
    prompts = make_prompts(6, seed=8, shared=6, lo=4, hi=8)
    eng, res = check(
        pair, router, bernoulli_decide(router), prompts, 14, num_slots=48, mode="threaded"
    )
    assert res.stats.preemptions > 0
    res2 = eng.generate(prompts[:3], 6)  # warm, full trees: must evict and stay exact
    _, ref = check(pair, router, bernoulli_decide(router), prompts[:3], 6, num_slots=48)
    assert res2.tokens == ref.tokens
    assert eng.idle_invariant()


@pytest.mark.parametrize(
    "router",
    [
        ScriptedRouter({0: [0], 1: [3], 2: [5, 6, 7]}),
        ScriptedRouter(every=True),
        ScriptedRouter(),
    ],
)
def test_threaded_scripted(pair: Any, router: ScriptedRouter) -> None:
    prompts = [*make_prompts(3, seed=40, shared=5), make_prompts(1, seed=40, shared=5)[0]]
    _, res = check(pair, router, router.decide, prompts, 10, num_slots=256, mode="threaded")
    assert res.stats.tokens == 40


def test_threaded_equals_event_loop_and_stream(pair: Any) -> None:
    small, large = pair
    router = BernoulliRouter(0.2, seed=11)
    prompts = make_prompts(7, seed=11, shared=10)
    sched = SchedulerConfig(max_running=3, min_large_batch=2, max_wait_s=0.001)
    events = RoutedEngine(
        small, large, router, config=EngineConfig(num_slots=512, scheduler=sched)
    ).generate(prompts, 9)
    eng = RoutedEngine(
        small, large, router, config=EngineConfig(num_slots=512, scheduler=sched, mode="threaded")
    )
    tokens: list[list[int]] = [[] for _ in prompts]
    for rid, tok, _ in eng.stream(prompts, 9):
        tokens[rid].append(tok)
    assert tokens == events.tokens
    assert eng.idle_invariant()


class _Boom(Router):
    def route(self, f: Any) -> Any:
        raise RuntimeError("router failed")


def test_worker_exception_reaches_caller_and_threads_stop(pair: Any) -> None:
    eng = RoutedEngine(*pair, _Boom(), config=EngineConfig(num_slots=256, mode="threaded"))
    with pytest.raises(RuntimeError, match="router failed"):
        eng.generate(make_prompts(3, seed=1), 5)
    assert no_worker_threads()


def test_abandoned_stream_stops_threads(pair: Any) -> None:
    eng = RoutedEngine(
        *pair, BernoulliRouter(0.3), config=EngineConfig(num_slots=256, mode="threaded")
    )
    it = eng.stream(make_prompts(4, seed=2), 20)
    next(it)
    it.close()
    assert no_worker_threads()


def test_threaded_needs_cursors(pair: Any) -> None:
    with pytest.raises(ValueError):
        RoutedEngine(
            *pair, ScriptedRouter(), config=EngineConfig(dispatch="naive", mode="threaded")
        )
