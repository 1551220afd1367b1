"""Requests sharing a prompt prefix with one still waiting for its prefill are held back a step,
so the shared prefix is computed once (then matched in the tree), in both run modes."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import make_prompts
from test_exactness import bernoulli_decide, check

from tokencache_routing import BernoulliRouter
from tokencache_routing.scheduler import SchedulerConfig


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_shared_prefix_prefilled_once(pair: Any, mode: str) -> None:
    router = BernoulliRouter(0.2, seed=17)
    shared = 20
    prompts = make_prompts(6, seed=17, shared=shared, lo=2, hi=6)
    prompts.append(list(prompts[2]))  # an identical prompt: only its last token is computed
    sched = SchedulerConfig(max_running=8)
    _, res = check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        8,
        num_slots=1024,
        scheduler=sched,
        mode=mode,
    )
    assert res.stats.held_back > 0 and res.stats.preemptions == 0
    # Every position of every request is computed by the small model exactly once, except the
    # shared prefix (once in all) and what the identical prompt matches.
    written = sum(len(p) + len(t) - 1 for p, t in zip(prompts, res.tokens, strict=True))
    matched = (len(prompts) - 2) * shared + len(prompts[2]) - 1
    assert res.stats.small_tokens == written - matched


def test_unrelated_prompts_not_held_back(pair: Any) -> None:
    router = BernoulliRouter(0.2, seed=18)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    _, res = check(pair, router, bernoulli_decide(router), prompts, 5, num_slots=256)
    assert res.stats.held_back == 0
