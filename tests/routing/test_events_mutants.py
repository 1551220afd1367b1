"""The event loop's clock and time accounts: every account is a sum of durations, so none is
ever negative and none exceeds the engine clock, whatever the dispatch, overlap, topology or
host charge (a sign flipped in one of its many `+=` shows here, in the configuration whose
path adds to it); tokens are delivered in clock order within the clock; a host-bound
overlapped engine's clock holds all its host time; start() serves requests."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
from routing_helpers import make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    GpuClock,
    RoutedEngine,
    SchedulerConfig,
)

CONFIGS = [
    dict(overlap=False, topology="one-device"),
    dict(overlap=False, topology="two-devices"),
    dict(overlap=True, topology="one-device"),
    dict(overlap=True, topology="two-devices"),
    dict(dispatch="naive"),
    dict(overlap=False, host_charge="overlap"),
    dict(overlap=False, host_charge="trees"),
]
# Durations on the engine clock (modeled_s is the clock itself).
ON_THE_CLOCK = ("small_device_s", "device_idle_s", "small_idle_s")


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{v}" for v in kw.values()))
def test_every_time_account_is_a_non_negative_part_of_the_clock(
    pair: Any, kw: dict[str, Any]
) -> None:
    eng = RoutedEngine(
        *pair,
        BernoulliRouter(0.3, seed=5),
        config=EngineConfig(
            num_slots=2048,
            clock=GpuClock(profile="h200-roofline"),
            scheduler=SchedulerConfig(max_running=4, min_large_batch=2),
            **kw,
        ),
    )
    eng.generate(make_prompts(6, seed=81, shared=12), 10)
    st = eng.stats
    assert st.escalations > 0 and st.steps > 0
    times = {
        f.name: getattr(st, f.name)
        for f in dataclasses.fields(st)
        if f.name.endswith("_s") and isinstance(getattr(st, f.name), float)
    }
    assert all(v >= 0 for v in times.values()), times
    assert st.small_forward_s > 0 and st.large_forward_s > 0 and st.host_s > 0
    assert st.small_host_s <= st.host_s
    for name in ON_THE_CLOCK:
        assert times[name] <= st.modeled_s, (name, times)
    assert st.modeled_s == eng.now() > 0


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{v}" for v in kw.values()))
def test_tokens_are_delivered_in_clock_order_within_the_clock(
    pair: Any, kw: dict[str, Any]
) -> None:
    eng = RoutedEngine(
        *pair,
        BernoulliRouter(0.3, seed=6),
        config=EngineConfig(num_slots=2048, clock=GpuClock(profile="h200-roofline"), **kw),
    )
    handles = [eng.submit(p, 6) for p in make_prompts(4, seed=83, shared=8)]
    assert all(h.wait(60) for h in handles)
    for h in handles:
        times = h.token_times
        assert len(times) == 6 and times[0] > 0
        assert times == sorted(times) and times[-1] <= eng.now()


def _host_bound_clock(tmp_path: Path) -> GpuClock:
    """A fitted clock whose every forward costs a nanosecond: the host's time is all."""
    rows = [
        {"model": m, "path": "torch", "kind": "decode", "batch": b, "new_tokens": n,
         "context": 64, "step_ms": 1e-6}
        for m in ("qwen3-0.6b", "qwen3-8b")
        for b, n in ((1, 1), (8, 8), (1, 16), (2, 64))  # decode, then multi-token forwards
    ]  # fmt: skip
    path = tmp_path / "host_bound.json"
    path.write_text(json.dumps({"rows": rows}))
    return GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b")


@pytest.mark.parametrize("topology", ["one-device", "two-devices"])
def test_a_host_bound_overlapped_clock_holds_all_its_host_time(
    pair: Any, tmp_path: Path, topology: str
) -> None:
    """With overlap the host clock pays every launch's and finish's host time in turn (the
    device's nanoseconds hide none of it): the engine clock is at least the small model's
    host time."""
    eng = RoutedEngine(
        *pair,
        BernoulliRouter(0.3, seed=7),
        config=EngineConfig(
            num_slots=2048, clock=_host_bound_clock(tmp_path), overlap=True, topology=topology
        ),
    )
    eng.generate(make_prompts(4, seed=85, shared=8), 8)
    st = eng.stats
    assert st.small_device_s < 1e-3 * st.small_host_s
    assert st.modeled_s >= st.small_host_s > 0


def test_a_started_event_loop_serves_requests_in_its_thread(pair: Any) -> None:
    """Nobody waits on the handles (a wait would drive the engine inline): only the started
    loop's thread can finish them."""
    eng = RoutedEngine(*pair, BernoulliRouter(0.3, seed=8), config=EngineConfig(num_slots=512))
    eng.start()
    try:
        handles = [eng.submit(p, 4) for p in make_prompts(2, seed=87)]
        deadline = time.monotonic() + 20
        while not all(h.done() for h in handles) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(h.done() for h in handles)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("topology", ["one-device", "two-devices"])
def test_the_trees_charge_counts_each_trees_call_once(
    pair: Any, tmp_path: Path, topology: str
) -> None:
    """host_charge="trees" on a host-bound clock with overlap: the host clock pays the trees'
    time and nothing else, each call once, so the engine clock is the trees' time in all
    (Stats.bookkeeping_s) to within the forwards' nanoseconds."""
    eng = RoutedEngine(
        *pair,
        BernoulliRouter(0.3, seed=7),
        config=EngineConfig(
            num_slots=2048,
            clock=_host_bound_clock(tmp_path),
            overlap=True,
            topology=topology,
            host_charge="trees",
        ),
    )
    eng.generate(make_prompts(6, seed=85, shared=8), 10)
    st = eng.stats
    assert st.escalations > 0 and st.bookkeeping_s > 0
    assert st.modeled_s == pytest.approx(st.bookkeeping_s, abs=1e-6)
