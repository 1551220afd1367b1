"""When a catch-up launches: batch size, waiting time, and holes in the small model's batch."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import bernoulli_decide, check, make_prompts

from tokencache_routing import BernoulliRouter, RoutedEngine, ScriptedRouter
from tokencache_routing.core.scheduler import SchedulerConfig


def test_launch_rules() -> None:
    cfg = SchedulerConfig(max_running=8, min_large_batch=4, max_wait_steps=3, min_occupancy=0.8)
    launch = cfg.launch_large
    assert not launch(0, True, 0, 0)  # nothing parked
    assert launch(1, False, 0, 1)  # the small model has nothing else to run
    assert launch(4, False, 8, 12)  # a big enough batch
    assert launch(1, True, 8, 9)  # the oldest waited long enough
    # The queue refilled the parked places: 8 of 8 could-run on the small model, no hole.
    assert not launch(3, False, 8, 11)
    # A drained tail: 7 of 8 could-run (87.5% >= 80%) waits, 6 of 8 (75%) launches.
    assert not launch(1, False, 7, 8)
    assert launch(2, False, 6, 8)
    # Fewer admitted than max_running: what could run is all of them.
    assert not launch(1, False, 5, 6)  # 5/6 = 83%
    assert launch(2, False, 4, 6)  # 4/6 = 67%
    off = SchedulerConfig(max_running=8, min_large_batch=4, max_wait_steps=3, min_occupancy=0)
    assert not off.launch_large(3, False, 1, 4)
    # The large model on its own device: a catch-up stalls nobody, so one parked request goes.
    assert launch(1, False, 8, 9, own_device=True)
    assert not launch(0, True, 0, 0, own_device=True)


def test_two_devices_refill_the_places_of_requests_in_a_catchup(pair: Any) -> None:
    """Two devices: a request inside a catch-up holds no place in the small batch (its place
    is refilled, as a parked one's is), and the catch-up launches at the first parked request
    whatever min_large_batch says (the large device is idle)."""
    small, large = pair
    router = ScriptedRouter({0: [0]})  # route_key 0 escalates its first token
    sched = SchedulerConfig(
        max_running=2, max_parked=2, min_large_batch=100, max_wait_steps=100, min_occupancy=0
    )
    # The serial schedule's step counts (overlap adds a step of lag).
    eng = RoutedEngine(
        small, large, router, 512, scheduler=sched, large_step_cost=50.0,
        topology="two-devices", clock="steps", overlap=False,
    )  # fmt: skip
    a = eng.submit([1, 2, 3], 4, route_key=0)
    b = eng.submit([4, 5, 6], 2, route_key=1)  # finishes while a's catch-up is in flight
    c = eng.submit([7, 8, 9], 30, route_key=2)
    d = eng.submit([2, 4, 6], 30, route_key=3)
    while not eng.sched.inflight:
        assert eng.iterate()
    assert [r.rid for r in eng.sched.inflight] == [a.rid]
    assert len(eng.sched.stats.catchup_batch_sizes) == 1  # launched with one parked request
    while eng.iterate():
        pass
    # b finished at step 2 and d took its place at once, while a's catch-up (50 steps) was in
    # flight (counting a's place as taken kept d out until c finished, at step 31).
    assert b.token_times[-1] <= 2
    assert d.token_times[0] <= b.token_times[-1] + 1
    assert 50 <= a.token_times[0] < 60
    assert all(h.finished_reason == "length" for h in (a, b, c, d))
    assert eng.idle_invariant()


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.9", float("nan")])
def test_min_occupancy_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="min_occupancy"):
        SchedulerConfig(min_occupancy=bad)


def _run(pair: Any, min_occupancy: float) -> Any:
    router = BernoulliRouter(0.2, seed=23)
    prompts = make_prompts(16, seed=23, shared=0, lo=3, hi=7)
    sched = SchedulerConfig(
        max_running=8,
        max_parked=0,  # no refill: every parked request is a hole
        min_large_batch=100,
        max_wait_steps=100,
        min_occupancy=min_occupancy,
    )
    # Without overlap: its dropped rows would count in the batch sizes measured here.
    _, res = check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        12,
        num_slots=2048,
        scheduler=sched,
        overlap=False,
    )
    return res.stats


def test_holes_launch_catchups_and_keep_the_batch_full(pair: Any) -> None:
    """With catch-ups that would otherwise wait for 100 parked requests, min_occupancy keeps
    every small step at >= 90% of what could run; without it the batch drains first. Tokens
    stay exact either way (check compares them with the no-cache reference)."""
    guarded = _run(pair, 0.9)
    per_step = [
        b / c for b, c in zip(guarded.small_batch_sizes, guarded.small_batch_capacity, strict=True)
    ]
    assert min(per_step) >= 0.9
    unguarded = _run(pair, 0.0)
    assert unguarded.small_batch_occupancy < 0.9
    # Without the guard the catch-ups wait until the small model runs dry: fewer and bigger.
    assert len(unguarded.catchup_batch_sizes) < len(guarded.catchup_batch_sizes)


# The threaded driver runs the tokencache dispatch only.
@pytest.mark.parametrize(
    "mode,dispatch", [("events", "tokencache"), ("events", "naive"), ("threaded", "tokencache")]
)
def test_small_batch_never_exceeds_max_running(pair: Any, mode: str, dispatch: str) -> None:
    """Requests back from a catch-up whose places were refilled wait a step instead of
    overfilling the batch (max_parked admits beyond max_running while others are parked)."""
    router = BernoulliRouter(0.3, seed=29)
    prompts = make_prompts(14, seed=29, shared=4, lo=2, hi=6)
    sched = SchedulerConfig(max_running=4, max_parked=4, min_large_batch=3, max_wait_steps=2)
    _, res = check(
        pair,
        router,
        bernoulli_decide(router),
        prompts,
        10,
        num_slots=2048,
        scheduler=sched,
        dispatch=dispatch,
        mode=mode,
    )
    assert max(res.stats.small_batch_sizes) == 4
    st = res.stats
    assert all(b <= c for b, c in zip(st.small_batch_sizes, st.small_batch_capacity, strict=True))
