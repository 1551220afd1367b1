"""When a catch-up launches: batch size, waiting time, and holes in the small model's batch."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import bernoulli_decide, check, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.core.scheduler_config import SchedulerConfig


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
        small,
        large,
        router,
        config=EngineConfig(
            num_slots=512,
            scheduler=sched,
            large_step_cost=50.0,
            topology="two-devices",
            clock="steps",
            overlap=False,
        ),
    )
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


# ---------------------------------------------------------------- launch="cost"


def _price(small_fixed: float, small_per_kv: float, large_fixed: float) -> Any:
    """A linear clock: a forward costs its fixed part plus its KV read (no batch term)."""

    def price(kind: int, batch: int, tokens: int, kv: int) -> float:
        if batch <= 0:
            return 0.0
        if kind == 0:
            return small_fixed + small_per_kv * kv
        return large_fixed + 1e-6 * kv

    return price


def test_cost_policy_prices_holes_and_catchups() -> None:
    """hole_loss_s is the holes' share of the small step's fixed part; catchup_fixed_s the
    catch-up's fixed part; on the roofline a compute-bound catch-up has none."""
    from tokencache_routing import GpuClock
    from tokencache_routing.core.launch_policy import catchup_fixed_s, hole_loss_s

    kv_bound = _price(0.4e-3, 1e-6, 5e-3)  # 8k contexts: a step is 256 ms of KV, 0.4 of weights
    loss = hole_loss_s(kv_bound, 31, 31, 31 * 8192, 1, 8192)
    assert loss == pytest.approx(0.4e-3 / 32)
    # The parked request's context is the batch's mean: the same as the time its token
    # would take at the full batch's rate minus what its hole saves the step.
    full, now = kv_bound(0, 32, 32, 32 * 8192), kv_bound(0, 31, 31, 31 * 8192)
    assert loss == pytest.approx(full / 32 - (full - now))
    # A longer parked context defers a read, it does not save it: the loss stays positive.
    assert hole_loss_s(kv_bound, 31, 31, 31 * 100, 1, 8192) == pytest.approx(0.4e-3 / 32)
    assert hole_loss_s(kv_bound, 32, 32, 32 * 8192, 0, 0) == 0.0
    assert catchup_fixed_s(kv_bound, 8, 80, 8 * 8192) == pytest.approx(5e-3)
    assert catchup_fixed_s(kv_bound, 0, 0, 0) == 0.0

    clock = GpuClock("qwen3-0.6b", "qwen3-8b", profile="h200-roofline")
    weights = catchup_fixed_s(clock.forward_s, 8, 80, 8 * 8192)  # memory-bound: the weight read
    assert 4e-3 < weights < 6e-3
    assert catchup_fixed_s(clock.forward_s, 32, 32 * 256, 32 * 256) == 0.0  # compute-bound


def test_cost_policy_decisions() -> None:
    """A cheap hole waits, an expensive one launches, hard triggers launch whatever the cost,
    and min_large_batch / min_occupancy do not apply."""
    from tokencache_routing.core.launch_policy import catchup_fixed_s, hole_loss_s

    cfg = SchedulerConfig(max_running=32, min_large_batch=1, min_occupancy=0.99, launch="cost")
    cheap = _price(0.4e-3, 1e-6, 5e-3)  # KV-bound small steps (long contexts)
    dear = _price(2e-3, 0.0, 5e-3)  # weight-bound ones: a hole wastes 1/32 of 2 ms
    fixed = catchup_fixed_s(cheap, 1, 10, 8192)
    loss = {name: 0.0 for name in ("cheap", "dear")}
    waited = {}
    for step in range(1, 200):
        for name, price in (("cheap", cheap), ("dear", dear)):
            if name in waited:
                continue
            loss[name] += hole_loss_s(price, 31, 31, 31 * 8192, 1, 8192)
            if cfg.launch_large(1, False, 31, 32, hole_loss_s=loss[name], fixed_s=fixed):
                waited[name] = step
    assert waited == {"dear": 80}  # 80 * 2 ms / 32 = 5 ms; the cheap hole waits on
    assert not cfg.launch_large(1, False, 31, 32, hole_loss_s=loss["cheap"], fixed_s=fixed)
    # hard triggers
    assert not cfg.launch_large(0, True, 0, 0)
    assert cfg.launch_large(1, False, 0, 1, fixed_s=fixed)  # nothing else to run
    assert cfg.launch_large(1, True, 31, 32, fixed_s=fixed)  # a partial catch-up, or a cap
    assert cfg.launch_large(1, False, 31, 32, own_device=True, fixed_s=fixed)
    capped = SchedulerConfig(max_running=32, max_large_batch=4, launch="cost")
    assert not capped.launch_large(3, False, 29, 32, fixed_s=fixed)
    assert capped.launch_large(4, False, 28, 32, fixed_s=fixed)
    # max_wait: a latency cap only when given
    assert not cfg.waited_out(1000, 0) and cfg.waited_out(8, 8) and not cfg.waited_out(7, 8)
    assert SchedulerConfig().waited_out(0, 0)  # threshold: 0 is "launch at once"


def test_cost_policy_refused_value() -> None:
    with pytest.raises(ValueError, match="launch"):
        SchedulerConfig(launch="sometimes")  # type: ignore[arg-type]


def test_measured_prices_learn_from_forwards() -> None:
    from tokencache_routing.core.launch_policy import MeasuredPrices, catchup_fixed_s

    m = MeasuredPrices(decay=0.5)
    assert m(0, 4, 4, 100) == 0.0 and catchup_fixed_s(m, 2, 2, 0) == 0.0  # nothing seen yet
    m.observe(0, 2.0)
    m.observe(0, 4.0)
    assert m(0, 4, 4, 100) == pytest.approx(3.0) and m(0, 0, 0, 0) == 0.0
    m.observe(1, 9.0)
    m.observe(1, 7.0)
    m.observe(1, 8.0)
    assert catchup_fixed_s(m, 3, 30, 300) == pytest.approx(7.0)  # the least catch-up seen


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_cost_policy_accumulates_and_resets(pair: Any, mode: str) -> None:
    """Step clock: a small step costs 1 and a catch-up 2 (its fixed part). One parked request
    of four leaves a quarter of each step empty (1/4 lost a step), so its catch-up launches
    after 8 steps (threshold with min_large_batch 1: at once), and the loss starts again from
    0 after it. Tokens stay exact (check)."""
    router = ScriptedRouter({0: [1]})  # request 0 escalates its second token
    prompts = make_prompts(4, seed=3, lo=3, hi=5)
    cfg = SchedulerConfig(max_running=4, max_parked=0, launch="cost")
    kw: dict[str, Any] = {"num_slots": 512, "scheduler": cfg, "large_step_cost": 2.0}
    kw |= {"clock": "steps", "overlap": False, "mode": mode}
    if mode == "threaded":  # its schedule depends on thread timing: exactness only
        check(pair, router, router.decide, prompts, 16, **kw)
        return
    small, large = pair
    eng = RoutedEngine(small, large, router, config=EngineConfig(**kw))
    handles = [eng.submit(p, 16, route_key=i) for i, p in enumerate(prompts)]
    losses, parked_at, launched_at = [], None, None
    while eng.iterate():
        s = eng.sched
        if s.parked and parked_at is None:
            parked_at = s.stats.steps
        if s.stats.catchup_batch_sizes and launched_at is None:
            launched_at = s.stats.steps
            assert s.hole_loss_s == 0.0  # reset by the launch
        losses.append(s.hole_loss_s)
    assert parked_at is not None and launched_at is not None
    # 8 small steps charged 1/4 each, then the iteration that launches it runs a step too
    assert launched_at - parked_at == 8 + 1
    assert max(losses) == pytest.approx(2.0)
    assert eng.idle_invariant()
    ref, _ = reference_generate(small, large, prompts, 16, router.decide)
    assert [h.tokens for h in handles] == ref
