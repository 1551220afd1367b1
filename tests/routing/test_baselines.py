"""The naive baselines pay what SGLang's protocol pays: on every return to a model, the
request's partial last page (never cached) is prefilled again. Token counts are checked
against tokencache's on the same schedule, so every "x naive" ratio rests on real work; and
no dispatcher leaks that partial page."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from routing_helpers import check_idle, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    ScriptedRouter,
    reference_generate,
)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
NAIVE = [
    "naive",
    pytest.param("naive-sglang", marks=pytest.mark.skipif(not HAVE_SGLANG, reason="sglang")),
]
ALL = ["tokencache", *NAIVE]


def distinct_prompts(n: int, seed: int) -> list[list[int]]:
    """No two share a first token, so nobody matches another's pages."""
    return [[i, *p] for i, p in enumerate(make_prompts(n, seed=seed, lo=3, hi=12))]


def reprefill(prompts: list[list[int]], models: list[list[int]], page: int) -> tuple[int, int]:
    """What the naive protocol computes beyond tokencache, per model, from the schedule's
    per-token models. Escalated at generated position k, a request's small KV holds L + k
    tokens, cached as whole pages: back on the small model (if it goes on) it prefills the
    (L + k) % page tokens of the partial page again. The large model after that catch-up
    holds L + k too: its next catch-up prefills (L + k) % page again."""
    small = large = 0
    for prompt, mods in zip(prompts, models, strict=True):
        ks = [k for k, m in enumerate(mods) if m == 1]
        small += sum((len(prompt) + k) % page for k in ks if k < len(mods) - 1)
        large += sum((len(prompt) + k) % page for k in ks[:-1])
    return small, large


@pytest.mark.parametrize("dispatch", NAIVE)
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_naive_reprefills_the_partial_page_on_every_return(
    pair: Any, dispatch: str, page_size: int
) -> None:
    router = BernoulliRouter(0.3, seed=41)
    prompts = distinct_prompts(6, seed=41)

    def run(d: str) -> Any:
        # tokencache without overlap: the naive dispatchers' schedule (they have none)
        eng = RoutedEngine(
            *pair,
            router,
            config=EngineConfig(num_slots=2048, dispatch=d, page_size=page_size, overlap=False),
        )
        res = eng.generate(prompts, 16)
        check_idle(eng)
        return res

    tc, naive = run("tokencache"), run(dispatch)
    # The same schedule: same tokens, steps and catch-up batches.
    assert naive.tokens == tc.tokens and naive.models == tc.models
    assert naive.stats.steps == tc.stats.steps
    assert naive.stats.catchup_batch_sizes == tc.stats.catchup_batch_sizes
    small, large = reprefill(prompts, tc.models, page_size)
    assert tc.stats.escalations >= 10  # enough returns to count
    if page_size > 1:
        assert small > 0 and large > 0
    assert naive.stats.small_tokens == tc.stats.small_tokens + small
    assert sum(naive.stats.catchup_tokens) == sum(tc.stats.catchup_tokens) + large
    # tokencache itself computes every position once per model it runs on.
    written = sum(len(p) + len(t) - 1 for p, t in zip(prompts, tc.tokens, strict=True))
    assert tc.stats.small_tokens == written


@pytest.mark.parametrize("dispatch", ALL)
@pytest.mark.parametrize("page_size", [2, 4])
def test_no_dispatcher_leaks_the_partial_page(pair: Any, dispatch: str, page_size: int) -> None:
    """Hand-offs at every phase of the page (prompt of 7, escalations at 2, 3, 4 and 7):
    after each generate every slot is free or cached, nothing pinned; twice, so a leak of even
    one slot per generate shows."""
    router = ScriptedRouter({0: [2, 3, 4, 7], 1: [0, 5]})
    prompts = [
        make_prompts(1, seed=63, lo=7, hi=7)[0],
        [90, *make_prompts(1, seed=64, lo=4, hi=4)[0]],
    ]
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=64, dispatch=dispatch, page_size=page_size)
    )
    ref, _ = reference_generate(*pair, prompts, 9, router.decide)
    for _ in range(2):
        assert eng.generate(prompts, 9).tokens == ref
        check_idle(eng)
