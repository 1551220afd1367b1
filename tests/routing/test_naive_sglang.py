"""dispatch="naive-sglang": the naive protocol through SGLang's own RadixCache is exact.

Same tokens as the no-cache reference and as the other dispatches; slots SGLang evicts go back
to the model's KVPool, so at idle available + cache size == pool size. sglang must be
importable: a missing sglang FAILS these tests (CI installs it), it never skips them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from routing_helpers import make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.core.scheduler_config import SchedulerConfig

DISPATCH = "naive-sglang"


@pytest.fixture(scope="module", autouse=True)
def sglang_importable() -> None:
    from tokencache_routing.baselines.naive_sglang import sglang_api

    try:
        sglang_api()
    except ImportError as exc:
        pytest.fail(f"tests/routing/test_naive_sglang.py needs sglang: {exc}", pytrace=False)


def decide_of(router: BernoulliRouter) -> Any:
    return lambda rid, pos: bool(router.decide(np.array([rid]), np.array([pos]))[0])


def check_idle(eng: RoutedEngine) -> None:
    from tokencache_routing.baselines.naive_sglang import SGLangSide

    for side in eng.sides:
        assert isinstance(side, SGLangSide)
        assert side.pool.available + side.cache.total_size() == side.pool.num_slots
        assert side.cache.protected_size() == 0
        assert side.cache.evictable_size() == side.cache.total_size()
        assert not hasattr(side, "tree")  # SGLang's cache only: no tokencache tree
    assert eng.idle_invariant()


def run(pair: Any, router: Any, decide: Any, prompts: list[list[int]], max_new: int, **kw: Any):
    small, large = pair
    eng = RoutedEngine(small, large, router, config=EngineConfig(dispatch=DISPATCH, **kw))
    res = eng.generate(prompts, max_new)
    ref_tokens, ref_models = reference_generate(small, large, prompts, max_new, decide)
    assert res.tokens == ref_tokens
    assert res.models == ref_models
    check_idle(eng)
    return eng, res


@pytest.mark.parametrize("p,seed", [(0.1, 0), (0.3, 1), (0.5, 2), (0.2, 7)])
def test_bernoulli_seeds(pair: Any, p: float, seed: int) -> None:
    router = BernoulliRouter(p, seed=seed)
    prompts = make_prompts(5, seed=10 + seed)
    _, res = run(pair, router, decide_of(router), prompts, 12, num_slots=512)
    assert res.stats.escalations > 0
    assert res.stats.bookkeeping_s > 0


def test_scripted_positions(pair: Any) -> None:
    router = ScriptedRouter({0: [0], 1: [3], 2: [5, 6, 7], 3: list(range(0, 10, 2))})
    prompts = make_prompts(4, seed=3)
    run(pair, router, router.decide, prompts, 10, num_slots=512)


def test_shared_prefix_cached_once(pair: Any) -> None:
    router = BernoulliRouter(0.3, seed=5)
    prompts = make_prompts(9, seed=5, shared=24, lo=1, hi=6)
    sched = SchedulerConfig(max_running=4, min_large_batch=3, max_wait_steps=3)
    eng, res = run(pair, router, decide_of(router), prompts, 10, num_slots=1024, scheduler=sched)
    unshared = sum(len(p) + len(t) for p, t in zip(prompts, res.tokens, strict=True))
    assert eng.small.cache.total_size() <= unshared - 8 * 24


def test_tiny_pool_evicts_through_the_allocator(pair: Any) -> None:
    router = BernoulliRouter(0.25, seed=8)
    prompts = make_prompts(6, seed=8, shared=6, lo=4, hi=8)
    eng, res = run(pair, router, decide_of(router), prompts, 14, num_slots=48)
    assert res.stats.preemptions > 0
    assert sum(s.allocator.freed for s in eng.sides) > 0  # SGLang's evictions reached the pool
    # A second call on the warm (full) caches must evict and stay exact.
    res2 = eng.generate(prompts[:3], 6)
    ref, _ = reference_generate(*pair, prompts[:3], 6, decide_of(router))
    assert res2.tokens == ref
    check_idle(eng)


@pytest.mark.parametrize("seed", [11, 12])
def test_same_tokens_as_other_dispatches(pair: Any, seed: int) -> None:
    small, large = pair
    router = BernoulliRouter(0.2, seed=seed)
    prompts = make_prompts(7, seed=seed, shared=10)
    sched = SchedulerConfig(max_running=3, min_large_batch=2, max_wait_steps=2)
    out = {}
    for dispatch in ("tokencache", "naive", DISPATCH):
        eng = RoutedEngine(
            small,
            large,
            router,
            config=EngineConfig(num_slots=512, dispatch=dispatch, scheduler=sched),
        )
        out[dispatch] = eng.generate(prompts, 9)
        assert eng.idle_invariant()
    for dispatch in ("tokencache", "naive"):
        assert out[DISPATCH].tokens == out[dispatch].tokens
        assert out[DISPATCH].models == out[dispatch].models


def test_escalate_everything(pair: Any) -> None:
    prompts = make_prompts(4, seed=4)
    _, res = run(pair, ScriptedRouter(every=True), lambda r, p: True, prompts, 8, num_slots=256)
    assert all(m == [1] * 8 for m in res.models)


def test_threaded_mode_rejected(pair: Any) -> None:
    with pytest.raises(ValueError):
        RoutedEngine(
            *pair, ScriptedRouter(), config=EngineConfig(dispatch=DISPATCH, mode="threaded")
        )
