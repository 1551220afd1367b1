"""A request making its first catch-up on the large model in the same batch as another one with
the same prompt prefix is held for the next catch-up batch, so the large model computes the
shared prompt once (then matches it in the tree), in both run modes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from routing_helpers import bernoulli_decide, check, make_prompts

from tokencache_routing import BernoulliRouter, ScriptedRouter
from tokencache_routing.core.holdback import take_catchup_batch
from tokencache_routing.core.scheduler_config import SchedulerConfig
from tokencache_routing.core.state import GREEDY, Request

LARGE = 1


def shared_prompts(n: int, shared: int, seed: int) -> list[list[int]]:
    """n prompts with a common prefix of `shared` tokens and distinct first own tokens."""
    base = make_prompts(1, seed=seed, shared=shared, lo=0, hi=0)[0]
    return [[*base, (7 * i + 1) % 96, (3 * i + 5) % 96, i % 96] for i in range(n)]


@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prompt_prefilled_once_on_large(pair: Any, mode: str, page_size: int) -> None:
    n, shared, at = 6, 24, 3
    prompts = shared_prompts(n, shared, seed=40)
    # Every request escalates once, at the same position: their first catch-ups meet in one
    # batch (launched when all are parked: the small model then has nothing to run; the holes
    # the first parked ones leave do not launch anything).
    router = ScriptedRouter({i: [at] for i in range(n)})
    sched = SchedulerConfig(
        max_running=8, min_large_batch=n, max_wait_steps=100, max_wait_s=30.0, min_occupancy=0
    )
    _, res = check(
        pair,
        router,
        router.decide,
        prompts,
        8,
        num_slots=1024,
        scheduler=sched,
        page_size=page_size,
        mode=mode,
    )
    st = res.stats
    assert st.escalations == n and st.preemptions == 0
    # The large model computes each request's tokens up to its escalation, the shared prompt
    # (its whole pages) once: the others match it in the tree.
    matched = shared // page_size * page_size
    written = sum(len(p) + at for p in prompts)
    assert sum(st.catchup_tokens) == written - (n - 1) * matched
    if mode == "events":  # the threaded mode may already have split the batch in time
        assert st.large_held_back == n - 1
        assert st.catchup_batch_sizes == [1, n - 1]


@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize("p,seed", [(0.1, 0), (0.3, 1), (0.5, 2)])
def test_holdback_exact_with_bernoulli(pair: Any, mode: str, p: float, seed: int) -> None:
    router = BernoulliRouter(p, seed=seed)
    prompts = make_prompts(8, seed=50 + seed, shared=16, lo=2, hi=6)
    prompts.append(list(prompts[1]))  # an identical prompt
    sched = SchedulerConfig(max_running=6, min_large_batch=3, max_wait_steps=2, max_wait_s=0.002)
    _, res = check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        12,
        num_slots=1024,
        scheduler=sched,
        mode=mode,
    )
    # Without duplicate prefills the large model computes at most what was written, less the
    # shared prompt for every request but the first.
    written = sum(len(p) + len(t) - 1 for p, t in zip(prompts, res.tokens, strict=True))
    assert sum(res.stats.catchup_tokens) <= written - (len(prompts) - 1) * 16


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_holdback_under_memory_pressure(pair: Any, mode: str) -> None:
    router = BernoulliRouter(0.3, seed=4)
    prompts = make_prompts(7, seed=60, shared=12, lo=2, hi=6)
    sched = SchedulerConfig(max_running=5, min_large_batch=2, max_wait_steps=2, max_wait_s=0.002)
    check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        12,
        num_slots=60,
        scheduler=sched,
        mode=mode,
    )


class _Handle:
    def __init__(self) -> None:
        self.attached = False
        self.length = 0  # committed tokens (once attached)


def _request(i: int, prompt: list[int]) -> Request:
    return Request(i, i, np.asarray(prompt, dtype=np.int64), 4, GREEDY, frozenset())


def test_held_request_goes_in_next_batch() -> None:
    """Held once, never again: a request held back joins the next batch whatever it shares."""
    reqs = [_request(i, [1, 2, 3, 4, 5, 10 + i]) for i in range(3)]
    other = _request(3, [9, 8, 7])
    for r in [*reqs, other]:
        r.kv = [_Handle(), _Handle()]
    batch, rest, held = take_catchup_batch([*reqs, other], 8, LARGE, 1)
    assert batch == [reqs[0], other] and rest == held == reqs[1:]
    # Nothing attached in between (worst case): the held ones still all go now.
    batch, rest, held = take_catchup_batch(rest, 8, LARGE, 1)
    assert batch == reqs[1:] and rest == held == []
    # Attached handles (not a first catch-up) and a short overlap are never held.
    fresh = [_request(i, [1, 2, 3, 4, 5, 10 + i]) for i in range(2)]
    fresh[0].kv, fresh[1].kv = [_Handle(), _Handle()], [_Handle(), _Handle()]
    fresh[1].kv[LARGE].attached = True
    assert take_catchup_batch(fresh, 8, LARGE, 1)[0] == fresh
    fresh[1].kv[LARGE].attached = False
    assert take_catchup_batch(fresh, 8, LARGE, 8)[0] == fresh  # 5 shared tokens < a page of 8
    # The batch cap: requests beyond it stay parked in order, not counted as held.
    batch, rest, held = take_catchup_batch([other, *fresh], 1, LARGE, 1)
    assert batch == [other] and rest == fresh and held == []


def test_a_cached_prompt_holds_nobody_back(pair: Any) -> None:
    """The hold-backs ask the model side how much of a prompt its cache holds
    (ModelSide.cached_prefix_len): once a system prompt is cached, requests on it are admitted
    together and catch up together (nothing held back), where an uncached one holds them."""
    from tokencache_routing import EngineConfig, RoutedEngine

    system = make_prompts(1, seed=21, shared=0, lo=24, hi=24)[0]
    prompts = [system + q for q in make_prompts(6, seed=22, shared=0, lo=3, hi=6)]
    cold = RoutedEngine(*pair, ScriptedRouter(default=[1]), config=EngineConfig(num_slots=1024))
    cold.generate(prompts, 4)
    assert cold.stats.held_back > 0
    warm = RoutedEngine(*pair, ScriptedRouter(default=[0, 1]), config=EngineConfig(num_slots=1024))
    warm.generate([system], 1)  # cached in both models (escalated at its first token)
    warm.router = ScriptedRouter(default=[1])
    before = (warm.stats.held_back, warm.stats.large_held_back)
    warm.generate(prompts, 4)
    assert (warm.stats.held_back, warm.stats.large_held_back) == before == (0, 0)
    assert warm.idle_invariant()
