"""The GPU cost clock's bounds are tight where they can be: a lower bound that is merely low
passes every "no schedule undercuts it" test, so these pin its exact value."""

from __future__ import annotations

import pytest

from tokencache_routing.sim.clock import ForwardCost, Linear


def test_linear_floor_is_the_fit_at_one_row_of_all_tokens_and_kv() -> None:
    # With one fit the floor is the fit at one row writing every token and reading every KV
    # slot (the cheapest split of the work), exactly: a forward of one token is that forward.
    fit = Linear(a=0.004, b=2e-5, c=3e-4, d=1e-8)
    cost = ForwardCost("qwen3-0.6b", fit)
    assert cost.floor(1, 4096) == pytest.approx(cost(1, 1, 4096), rel=1e-12)
    for n, kv in ((1, 0), (8, 4096), (32, 100_000)):
        assert cost.floor(n, kv) == pytest.approx(fit(1, n, kv), rel=1e-12)
