"""The scheduler's promises, each checked on every step it makes: max_running and max_admitted
never exceeded, a bounded wait between any two tokens of a request when more are admitted than
the small batch holds, the newest request preempted, catch-ups never started before their
requests were parked (one device and two)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from routing_helpers import bernoulli_decide, make_prompts

from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine, reference_generate
from tokencache_routing.core.scheduler import Scheduler
from tokencache_routing.core.scheduler_config import SchedulerConfig


def distinct_prompts(n: int, seed: int, lo: int = 3, hi: int = 10) -> list[list[int]]:
    """No two share a first token: no hold-back, no shared pages."""
    return [[i, *p] for i, p in enumerate(make_prompts(n, seed=seed, lo=lo, hi=hi))]


def exact(pair: Any, router: BernoulliRouter, prompts: list[list[int]], handles: list[Any]) -> None:
    n = max(len(h.tokens) for h in handles)
    ref, _ = reference_generate(*pair, prompts, n, bernoulli_decide(router))
    for h, r in zip(handles, ref, strict=True):
        assert h.finished_reason == "length" and h.tokens == r[: len(h.tokens)]


class Watch:
    """Wraps a scheduler's admit, make_room, preempt and finish_large to record what each
    step did; violations are collected (a worker thread must not raise them) and asserted by
    the test."""

    def __init__(self, s: Scheduler, large_step_cost: float | None = None) -> None:
        """large_step_cost: check each catch-up's start (event loop, steps clock)."""
        self.s, self.cost = s, large_step_cost
        self.violations: list[str] = []
        self.victims: list[tuple[int, list[int]]] = []  # (victim's admit_order, candidates')
        self.catchups = 0
        self._batch: list[Any] = []
        self._admit, self._make_room = s.admit, s.make_room
        self._preempt, self._finish_large = s.preempt, s.finish_large
        s.admit = self.admit  # type: ignore[method-assign]
        s.make_room = self.make_room  # type: ignore[method-assign]
        s.preempt = self.preempt  # type: ignore[method-assign]
        s.finish_large = self.finish_large  # type: ignore[method-assign]

    def admit(self, not_after: float | None = None) -> None:
        self._admit(not_after)
        s, cfg = self.s, self.s.cfg
        if len(s.active()) > cfg.max_admitted:
            self.violations.append(f"{len(s.active())} admitted > {cfg.max_admitted}")
        # Each admitted request is on one list, and `busy` holds exactly those inside a
        # forward (busy_model set): Scheduler._unbusy clears the list by that flag.
        if len({id(r) for r in s.active()}) != len(s.active()):
            self.violations.append("a request is on two of the scheduler's lists")
        if any(r.busy_model == -1 for r in s.busy):
            self.violations.append("a request on the busy list is not inside a forward")
        if any(r.busy_model != -1 for r in s.running + s.parked + s.inflight):
            self.violations.append("a request inside a forward is off the busy list")

    def make_room(self, side: Any, batch: list[Any], kind: int, *rest: Any) -> None:
        self._batch = batch
        self._make_room(side, batch, kind, *rest)

    def preempt(self, r: Any) -> None:
        s = self.s
        # make_room has taken the victim out of its batch already
        pool = s.active() + [q for q in [*self._batch, r] if q not in s.active()]
        oldest = min(q.admit_order for q in pool)
        cands = [q.admit_order for q in pool if not q.busy and q.admit_order != oldest]
        self.victims.append((r.admit_order, cands))
        self._preempt(r)

    def finish_large(self, prep: Any, out: Any, now: float) -> Any:
        self.catchups += 1
        if self.cost is not None:  # steps clock, no host time: it started at now - cost
            start = now - self.cost
            for r in prep.batch:
                if r.parked_at > start + 1e-9:
                    self.violations.append(f"catch-up at {start}, rid {r.rid} parked {r.parked_at}")
        return self._finish_large(prep, out, now)


MODES = ["events", "threaded"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_parked", [0, 4, None])
def test_max_running_and_max_admitted_never_exceeded(pair: Any, mode: str, max_parked: Any) -> None:
    router = BernoulliRouter(0.3, seed=31)
    prompts = distinct_prompts(20, seed=31)
    sched = SchedulerConfig(max_running=4, max_parked=max_parked, min_large_batch=2)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=2048, scheduler=sched, mode=mode)
    )
    w = Watch(eng.sched)
    handles = [eng.submit(p, 10, route_key=i) for i, p in enumerate(prompts)]
    assert all(h.wait(120) for h in handles)
    assert not w.violations
    st = eng.stats
    assert max(st.small_batch_sizes) == 4
    assert all(b <= c for b, c in zip(st.small_batch_sizes, st.small_batch_capacity, strict=True))
    exact(pair, router, prompts, handles)
    assert eng.idle_invariant()
    eng.shutdown()  # joins threaded workers


@pytest.mark.parametrize("topology", ["one-device", "two-devices"])
def test_wait_between_two_tokens_is_bounded(pair: Any, topology: str) -> None:
    """Twice as many admitted as the small batch holds: requests back from catch-ups find
    their places refilled and wait their turn (longest waiting first): a few steps, never
    dozens, between any two of a request's tokens."""
    router = BernoulliRouter(0.3, seed=32)
    prompts = distinct_prompts(24, seed=32)
    sched = SchedulerConfig(max_running=4, max_parked=4)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=4096, scheduler=sched, topology=topology)
    )
    handles = [eng.submit(p, 24, route_key=i) for i, p in enumerate(prompts)]
    assert all(h.wait(120) for h in handles)
    gaps = [b - a for h in handles for a, b in itertools.pairwise(h.token_times)]
    # A token is delivered at its forward's end. The longest wait: 8 ready for 4 places, so a
    # request sits out two small steps and the catch-ups between them (cost 1 each), then its
    # own step writes a token that escalates and waits for its catch-up behind one queued
    # before it and a small step: 8 units here, starvation would be dozens.
    assert eng.overlap and max(gaps) <= 8, max(gaps)
    exact(pair, router, prompts, handles)


@pytest.mark.parametrize("mode", MODES)
def test_the_preemption_victim_is_the_newest(pair: Any, mode: str) -> None:
    router = BernoulliRouter(0.3, seed=33)
    prompts = distinct_prompts(8, seed=33, lo=6, hi=12)
    eng = RoutedEngine(
        *pair,
        router,
        config=EngineConfig(num_slots=72, scheduler=SchedulerConfig(max_running=8), mode=mode),
    )
    w = Watch(eng.sched)
    handles = [eng.submit(p, 24, route_key=i) for i, p in enumerate(prompts)]
    assert all(h.wait(120) for h in handles)
    assert len(w.victims) >= 3 and eng.stats.preemptions == len(w.victims)
    for victim, cands in w.victims:
        assert victim == max(cands), (victim, cands)
    exact(pair, router, prompts, handles)
    assert eng.idle_invariant()
    eng.shutdown()  # joins threaded workers


@pytest.mark.parametrize("topology,cost", [("one-device", 1.0), ("two-devices", 3.0)])
def test_catchups_never_start_before_their_requests_were_parked(
    pair: Any, topology: str, cost: float
) -> None:
    """Checked twice: on the scheduler (a catch-up's start against each request's parked_at),
    and on what the caller sees: a large token comes at least a small step (the escalating
    one) plus a catch-up after the token before it (or the submission)."""
    router = BernoulliRouter(0.4, seed=34)
    prompts = distinct_prompts(12, seed=34)
    sched = SchedulerConfig(max_running=4, max_parked=4)
    eng = RoutedEngine(
        *pair,
        router,
        config=EngineConfig(
            num_slots=4096, scheduler=sched, topology=topology, large_step_cost=cost
        ),
    )
    w = Watch(eng.sched, cost)
    # Submitted over time: the two clocks drift apart (two devices: the large one runs ahead).
    handles = []
    for i, p in enumerate(prompts):
        handles.append(eng.submit(p, 16, route_key=i))
        for _ in range(i % 3):
            eng.iterate()
    assert all(h.wait(120) for h in handles)
    assert w.catchups > 5 and not w.violations, w.violations
    for h in handles:
        times = [h.submitted_at, *h.token_times]
        for k, model in enumerate(h.models):
            if model == 1:
                assert times[k + 1] >= times[k] + 1 + cost, (h.rid, k, times[k], times[k + 1])
    exact(pair, router, prompts, handles)
