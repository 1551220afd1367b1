"""The engine clock on a scripted scenario timed by hand: every forward's modelled start and end
(the event loop's trace, drivers/forward_trace.py) on one device and on two, overlap off and
on, on the step clock (a small step costs 1, a catch-up LARGE_STEP); and the clock's rules,
which the routing tests check on every event-loop run (conftest.py), refusing a schedule that
breaks them.

The scenario: A (request 0, prompt [1, 2, 3]) and B (request 1, prompt [4, 5, 6, 7]), four new
tokens each, submitted together; the router escalates A's token 1 and B's token 2. A catch-up
launches as soon as one request is parked (min_large_batch=1) and writes the escalated token;
its request then decodes on the small model again."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tokencache_routing import (
    EngineConfig,
    RoutedEngine,
    SchedulerConfig,
    ScriptedRouter,
)
from tokencache_routing.drivers import events as events_module
from tokencache_routing.drivers.forward_trace import ForwardSpan, check_forwards, span_of

LARGE_STEP = 2.5  # a catch-up's cost on the step clock (a small step's is 1)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
NEW_TOKENS = 4
ESCALATED = {0: [1], 1: [2]}  # route_key -> escalated token positions
S, L = 0, 1  # which model wrote a token (RequestHandle.models)
MODELS = [[S, L, S, S], [S, S, L, S]]  # A's token 1 and B's token 2 come from the large model

Row = tuple[str, str, tuple[int, ...], float, float]  # ForwardSpan.row

# One device, overlap off: forwards run one after another, each starting where the one before
# ended; while a catch-up runs, the requests still decoding wait (small idle 2.5 + 2.5 = 5).
ONE_DEVICE: list[Row] = [
    ("small", "prefill", (0, 1), 0.0, 1.0),  # 0 + 1: both prompts, token 0 of each
    ("small", "decode", (0, 1), 1.0, 2.0),  # 1 + 1: A's token 1 escalated, A parked at 2
    ("large", "catch-up", (0,), 2.0, 4.5),  # 2 + 2.5: A's token 1; B waits
    ("small", "decode", (0, 1), 4.5, 5.5),  # 4.5 + 1: A's token 2; B's token 2 escalated
    ("large", "catch-up", (1,), 5.5, 8.0),  # 5.5 + 2.5: B's token 2; A waits
    ("small", "decode", (0, 1), 8.0, 9.0),  # 8 + 1: token 3 of both, both done at 9
]

# One device, overlap on: step k+1 is launched before step k is finished and queues behind it;
# a request step k parks has its row dropped from step k+1 (computed, not served), and its
# catch-up queues behind step k+1. The host finishes step k+1 before it waits for that
# catch-up (k+1 ends first on the device). Small idle: the two catch-ups, 2.5 + 2.5 = 5.
ONE_DEVICE_OVERLAP: list[Row] = [
    ("small", "prefill", (0, 1), 0.0, 1.0),  # 0 + 1
    ("small", "decode", (0, 1), 1.0, 2.0),  # 1 + 1: A parked at 2
    ("small", "decode", (1,), 2.0, 3.0),  # 2 + 1: A's row dropped; B's token 2 escalated
    ("large", "catch-up", (0,), 3.0, 5.5),  # behind the step before: 3 + 2.5
    # B's parking is known at 3 (its step finished while A's catch-up ran): B is not in the next
    ("small", "decode", (0,), 5.5, 6.5),  # 5.5 + 1: A's token 2, delivered at 6.5
    ("large", "catch-up", (1,), 6.5, 9.0),  # behind the step before: 6.5 + 2.5
    ("small", "decode", (1, 0), 9.0, 10.0),  # 9 + 1: token 3 of both, both done at 10
]

# Two devices, overlap off: a catch-up runs on the large device from max(its clock, the small
# clock) while the small model steps the others; its request rejoins at the first small step
# starting at or after its end; one catch-up at a time.
TWO_DEVICES: list[Row] = [
    ("small", "prefill", (0, 1), 0.0, 1.0),  # 0 + 1
    ("small", "decode", (0, 1), 1.0, 2.0),  # 1 + 1: A parked at 2
    ("large", "catch-up", (0,), 2.0, 4.5),  # max(0, 2) + 2.5
    ("small", "decode", (1,), 2.0, 3.0),  # 2 + 1: B's token 2 escalated, B parked at 3
    # B's catch-up waits for A's (in flight until 4.5): nothing to run, small idle 3 -> 4.5
    ("large", "catch-up", (1,), 4.5, 7.0),  # max(4.5, 4.5) + 2.5
    ("small", "decode", (0,), 4.5, 5.5),  # 4.5 + 1: A rejoined, token 2
    ("small", "decode", (0,), 5.5, 6.5),  # 5.5 + 1: A's token 3, done; small idle 6.5 -> 7
    ("small", "decode", (1,), 7.0, 8.0),  # 7 + 1: B rejoined, token 3, done at 8
]

# Two devices, overlap on: as without overlap, but the small step launched before B's parking
# was known holds only B's row: dropped, the step still runs (3 -> 4) and the small model then
# idles only 4 -> 4.5 (and 6.5 -> 7 as before).
TWO_DEVICES_OVERLAP: list[Row] = [
    ("small", "prefill", (0, 1), 0.0, 1.0),  # 0 + 1
    ("small", "decode", (0, 1), 1.0, 2.0),  # 1 + 1: A parked at 2
    ("small", "decode", (1,), 2.0, 3.0),  # 2 + 1: A's row dropped; B parked at 3
    ("large", "catch-up", (0,), 2.0, 4.5),  # launched next: max(0, host clock 2) + 2.5
    ("small", "decode", (), 3.0, 4.0),  # 3 + 1: its one row, B's, dropped
    ("large", "catch-up", (1,), 4.5, 7.0),  # after A's returns: max(4.5, 4.5) + 2.5
    ("small", "decode", (0,), 4.5, 5.5),  # 4.5 + 1: A's token 2
    ("small", "decode", (0,), 5.5, 6.5),  # 5.5 + 1: A's token 3, done
    ("small", "decode", (1,), 7.0, 8.0),  # 7 + 1: B's token 3, done at 8
]

# (topology, overlap) -> (forwards in launch order, engine clock at the end, small idle,
# dropped rows)
CASES: dict[tuple[str, bool], tuple[list[Row], float, float, int]] = {
    ("one-device", False): (ONE_DEVICE, 9.0, 5.0, 0),
    ("one-device", True): (ONE_DEVICE_OVERLAP, 10.0, 5.0, 1),
    ("two-devices", False): (TWO_DEVICES, 8.0, 1.5 + 0.5, 0),
    ("two-devices", True): (TWO_DEVICES_OVERLAP, 8.0, 0.5 + 0.5, 2),
}

# (topology, overlap) -> each request's tokens' delivery times (A's, B's): a token is delivered
# when the host finishes the forward that wrote it, at that forward's end on the step clock (no
# host time); a parking step's token is the catch-up's to write. With overlap on one device
# A's token 2 comes at its step's end, 6.5, not at the end of B's catch-up queued behind it.
DELIVERED: dict[tuple[str, bool], list[list[float]]] = {
    ("one-device", False): [[1.0, 4.5, 5.5, 9.0], [1.0, 2.0, 8.0, 9.0]],
    ("one-device", True): [[1.0, 5.5, 6.5, 10.0], [1.0, 2.0, 9.0, 10.0]],
    ("two-devices", False): [[1.0, 4.5, 5.5, 6.5], [1.0, 2.0, 7.0, 8.0]],
    ("two-devices", True): [[1.0, 4.5, 5.5, 6.5], [1.0, 2.0, 7.0, 8.0]],
}


def run_scenario(pair: Any, topology: str, overlap: bool) -> tuple[RoutedEngine, list[Any]]:
    small, large = pair
    config = EngineConfig(
        num_slots=256,
        clock="steps",
        large_step_cost=LARGE_STEP,
        topology=topology,  # type: ignore[arg-type]
        overlap=overlap,
        scheduler=SchedulerConfig(min_large_batch=1, launch="threshold"),
    )
    eng = RoutedEngine(small, large, ScriptedRouter(ESCALATED), config=config)
    handles = [eng.submit(p, NEW_TOKENS, route_key=i) for i, p in enumerate(PROMPTS)]
    assert all(h.wait(30) for h in handles)
    return eng, handles


def spans(eng: RoutedEngine) -> list[ForwardSpan]:
    trace = eng._events.trace
    assert trace is not None, "the routing tests' fixture turns the forward trace on"
    return sorted(trace.spans, key=lambda s: s.seq)


def as_spans(rows: list[Row], two_devices: bool) -> list[ForwardSpan]:
    """Hand-written rows as the spans the loop would record (launch order, devices)."""
    return [
        ForwardSpan(seq, model, kind, int(two_devices and model == "large"), rids, start, end)
        for seq, (model, kind, rids, start, end) in enumerate(rows, 1)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topology,overlap", list(CASES))
def test_every_forward_starts_and_ends_when_computed_by_hand(
    pair: Any, topology: str, overlap: bool
) -> None:
    """The loop's trace is the hand-computed schedule, forward by forward, and the totals
    (engine clock, small idle, dropped rows) follow from it."""
    forwards, now, small_idle, dropped = CASES[topology, overlap]
    eng, handles = run_scenario(pair, topology, overlap)
    got = spans(eng)
    assert [s.row for s in got] == forwards
    large_device = 1 if topology == "two-devices" else 0
    assert [s.device for s in got] == [large_device if s.model == "large" else 0 for s in got]
    assert [h.models for h in handles] == MODELS
    assert [h.token_times for h in handles] == DELIVERED[topology, overlap]
    assert eng.now() == now
    assert eng.stats.small_idle_s == small_idle
    assert eng.stats.dropped_rows == dropped
    assert eng._events.trace is not None and eng._events.trace.checked == len(got)
    # Every token is delivered when the forward that wrote it ends (a parking step's token is
    # the catch-up's to write): the host finishes forwards in the order they end on a device.
    for h in handles:
        mine = [s for s in got if h.rid in s.rids]
        writers = [
            s for s, nxt in zip(mine, [*mine[1:], None], strict=True)
            if not (s.model == "small" and nxt is not None and nxt.model == "large")
        ]  # fmt: skip
        assert len(h.token_times) == len(writers) == NEW_TOKENS
        assert h.token_times == [s.end for s in writers]
    check_forwards(got)


@pytest.mark.timeout(60)
def test_the_event_loop_refuses_a_catchup_recorded_before_its_parking(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs inside the loop (the fixture turns it on): a catch-up recorded a step
    before it starts fails the run with the forward named."""

    def early(*args: Any) -> ForwardSpan:
        span = span_of(*args)
        if span.model == "small":
            return span
        return replace(span, start=span.start - 2.0, end=span.end - 2.0)

    monkeypatch.setattr(events_module, "span_of", early)
    with pytest.raises(AssertionError, match=r"large catch-up .*the step that parked it"):
        run_scenario(pair, "one-device", False)


@pytest.mark.parametrize("topology,overlap", list(CASES))
def test_the_hand_computed_schedules_keep_the_clock_rules(topology: str, overlap: bool) -> None:
    check_forwards(as_spans(CASES[topology, overlap][0], topology == "two-devices"))


@pytest.mark.parametrize("topology,overlap", list(CASES))
def test_a_catchup_before_its_parking_is_refused(topology: str, overlap: bool) -> None:
    """Each case's first catch-up moved to start with the small step that parked its request
    (launched before that step ended): the rules name it."""
    two = topology == "two-devices"
    good = as_spans(CASES[topology, overlap][0], two)
    i = next(k for k, s in enumerate(good) if s.model == "large")
    parking = [s for s in good[:i] if set(good[i].rids) & set(s.rids)][-1]
    early = replace(good[i], start=parking.start, end=parking.start + LARGE_STEP)
    with pytest.raises(AssertionError, match=rf"forward #{early.seq} .*the step that parked it"):
        check_forwards([*good[:i], early, *good[i + 1 :]])


def test_two_forwards_at_once_on_one_device_are_refused() -> None:
    """Two requests' prefills overlapping in time (no rule of a request broken): refused on
    one device, fine on two."""
    first = ForwardSpan(1, "small", "prefill", 0, (0,), 0.0, 1.0)
    second = ForwardSpan(2, "large", "catch-up", 0, (1,), 0.5, 3.0)
    with pytest.raises(AssertionError, match=r"forward #2 .*on its device"):
        check_forwards([first, second])
    check_forwards([first, replace(second, device=1)])


def test_a_device_running_forwards_out_of_launch_order_is_refused() -> None:
    """Times monotone per device: a forward launched after another on its device may not run
    before it, even without overlapping it (two requests' prefills, no rule of theirs
    broken)."""
    first = ForwardSpan(1, "small", "prefill", 0, (0,), 2.0, 3.0)
    second = ForwardSpan(2, "small", "prefill", 0, (1,), 0.0, 1.0)
    with pytest.raises(AssertionError, match=r"forward #2 .*on its device"):
        check_forwards([second, first])  # in finishing order: the checker goes by launch


def test_a_forward_ending_before_it_starts_is_refused() -> None:
    good = as_spans(ONE_DEVICE, two_devices=False)
    with pytest.raises(AssertionError, match=r"forward #1 .*ends before it starts"):
        check_forwards([replace(good[0], end=-1.0), *good[1:]])
