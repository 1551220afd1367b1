"""Overlapped scheduling (EngineConfig(overlap=True), the default for tokencache): the next
small step is prepared and launched before the previous one is finished, its continuing rows
fed with their drawn token on the device. Outputs are identical with overlap on and off
(greedy and seeded sampling, escalations and catch-ups, both drivers); rows of requests the
previous step parked or ended are dropped and their slots freed; the clock charges only the
host time the device waits for."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
from routing_helpers import bernoulli_decide, check_idle, make_prompts

from tokencache_models import HostBatch
from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    EntropyRouter,
    RoutedEngine,
    SamplingParams,
    SchedulerConfig,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.core import batch_planning
from tokencache_routing.sim.clock import GpuClock

SAMPLING = [None, SamplingParams(0.9, seed=3), SamplingParams(1.3, 0.8, seed=4), None]


def run(pair: Any, overlap: bool, router: Any, **kw: Any) -> tuple[Any, list[Any]]:
    """Eight requests on two shared prompts (two sampled), 12 new tokens each."""
    prompts = make_prompts(8, seed=71, shared=9, lo=2, hi=6)
    prompts[4:] = [[5, *p[1:]] for p in prompts[4:]]  # a second system prompt
    eng = RoutedEngine(*pair, router, config=EngineConfig(overlap=overlap, **kw))
    handles = [
        eng.submit(p, 12, sampling=SAMPLING[i % 4], route_key=i) for i, p in enumerate(prompts)
    ]
    assert all(h.wait(120) for h in handles)
    eng.shutdown()  # joins threaded workers
    check_idle(eng)
    return eng, handles


@pytest.mark.parametrize(
    "mode,topology", [("events", "one-device"), ("events", "two-devices"), ("threaded", None)]
)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("p", [0.1, 0.35])
def test_outputs_are_identical_with_overlap_on_and_off(
    pair: Any, mode: str, topology: Any, page_size: int, p: float
) -> None:
    router = BernoulliRouter(p, seed=int(p * 100) + page_size)
    kw = dict(
        num_slots=1024,
        mode=mode,
        topology=topology,
        page_size=page_size,
        scheduler=SchedulerConfig(max_running=5, min_large_batch=2, max_wait_steps=2),
    )
    on, with_overlap = run(pair, True, router, **kw)
    off, without = run(pair, False, router, **kw)
    assert on.overlap and not off.overlap
    for a, b in zip(with_overlap, without, strict=True):
        assert (a.tokens, a.models, a.finished_reason) == (b.tokens, b.models, b.finished_reason)
    assert on.stats.escalations == off.stats.escalations > 0
    # Greedy requests are exact against the no-cache reference.
    prompts = make_prompts(8, seed=71, shared=9, lo=2, hi=6)
    prompts[4:] = [[5, *q[1:]] for q in prompts[4:]]
    ref, models = reference_generate(*pair, prompts, 12, bernoulli_decide(router))
    for i in (0, 3, 4, 7):
        assert with_overlap[i].tokens == ref[i] and with_overlap[i].models == models[i]
    if mode == "events":  # the event loop always continues rows: some were dropped
        assert on.stats.dropped_rows > 0 and off.stats.dropped_rows == 0


def test_continuing_rows_take_their_token_from_the_device(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In steady decoding every row of a step continues the pending one: its input token is
    deferred (DeferredTokens: the pending step's draw, indexed by its row there), never read
    on the host at preparation, and the placeholder is never what the model is fed."""
    seen: list[tuple[HostBatch, Any]] = []  # each forward's inputs as prepared
    real = batch_planning.prepare_forward

    def spy(*a: Any, **k: Any) -> Any:
        prep = real(*a, **k)
        seen.append((prep.host, prep.host.token_ids.copy()))
        return prep

    monkeypatch.setattr(batch_planning, "prepare_forward", spy)
    prompts = make_prompts(4, seed=72, shared=5)
    eng = RoutedEngine(*pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=512))
    res = eng.generate(prompts, 10)
    ref, _ = reference_generate(*pair, prompts, 10, lambda rid, pos: False)
    assert res.tokens == ref
    decode = [(hb, tok) for hb, tok in seen if hb.is_decode and hb.num_real == 4]
    deferred = [(hb, tok) for hb, tok in decode if hb.deferred is not None]
    assert len(deferred) >= 7  # every decode step after the first
    for hb, tok in deferred:
        assert hb.deferred is not None
        assert sorted(hb.deferred.dest.tolist()) == [0, 1, 2, 3]
        assert (tok[hb.deferred.dest] == 0).all()  # placeholders only on the host
    check_idle(eng)


def test_a_stop_token_drops_the_row_launched_after_it(pair: Any) -> None:
    """A request that ends on a stop token has a row in the step launched before its token
    was known: dropped, its slot freed, nothing delivered after the stop."""
    prompts = make_prompts(3, seed=73, shared=4)
    ref, _ = reference_generate(*pair, prompts, 12, lambda rid, pos: False)
    stop = ref[1][4]  # request 1's fifth token
    ends = [t.index(stop) + 1 if stop in t else 12 for t in ref]
    for overlap in (True, False):
        eng = RoutedEngine(
            *pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=512, overlap=overlap)
        )
        hs = [eng.submit(p, 12, stop_token_ids=[stop]) for p in prompts]
        assert all(h.wait(60) for h in hs)
        for h, r, n in zip(hs, ref, ends, strict=True):
            assert h.tokens == r[:n]
            assert h.finished_reason == ("stop" if n < 12 or r[-1] == stop else "length")
        assert (eng.stats.dropped_rows > 0) == overlap
        check_idle(eng)


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_aborts_and_escalations_of_every_row_mid_pipeline(pair: Any, mode: str) -> None:
    """Every request escalates at once, then one is aborted while its next row is in
    flight: the others stay exact, everything is released."""
    router = ScriptedRouter({0: [2], 1: [2], 2: [2, 3], 3: [5]})
    prompts = make_prompts(4, seed=74, shared=6)
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=512, mode=mode))
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    aborted = False
    for rid, tok, _ in eng.stream(prompts, 9):
        got[rid].append(tok)
        if rid == 3 and len(got[3]) == 4 and not aborted:
            aborted = eng.abort(3)
    ref, _ = reference_generate(*pair, prompts, 9, router.decide)
    for i in range(3):
        assert got[i] == ref[i]
    assert got[3] == ref[3][: len(got[3])]
    assert aborted or mode == "threaded"
    eng.shutdown()
    check_idle(eng)


def _pure_decode(pair: Any, overlap: bool) -> Any:
    eng = RoutedEngine(
        *pair,
        EntropyRouter(math.inf),
        config=EngineConfig(
            num_slots=2048,
            clock=GpuClock(profile="h200-roofline"),
            scheduler=SchedulerConfig(max_running=8),
            overlap=overlap,
        ),
    )
    eng.generate(make_prompts(8, seed=75, shared=40), 24)
    return eng.stats


def test_the_clock_charges_only_the_host_time_the_device_waits_for(pair: Any) -> None:
    """Without overlap the device waits for all the host's work (device_idle = host time);
    with it only for what the host takes beyond each step's device time: less than all of it,
    so the clock runs less than the serial charge of the same run's times. Each run is
    compared with its own measured host time (two runs' host times differ on a loaded
    machine)."""
    serial, overlapped = _pure_decode(pair, False), _pure_decode(pair, True)
    assert serial.tokens == overlapped.tokens and overlapped.dropped_rows == 0
    assert serial.device_idle_s == pytest.approx(serial.small_host_s)
    host, device = overlapped.small_host_s, overlapped.small_device_s
    assert overlapped.device_idle_s < host
    assert overlapped.modeled_s < device + host
    # Never below the device's own work, nor below the host's.
    assert overlapped.modeled_s >= overlapped.small_device_s
    assert overlapped.modeled_s >= overlapped.small_host_s


@pytest.mark.parametrize("topology", ["one-device", "two-devices"])
def test_waiting_for_a_catch_up_is_not_waiting_for_the_host(pair: Any, topology: str) -> None:
    """The GPU-idle figure is the time the small model's device waits for the host: never
    more than the host worked. Every token escalates here: on two devices every request is
    away at a catch-up on the other device now and then, time with nothing to run, which is
    the small model's idle time and not that (one device: catch-ups stall the small model,
    also its idle time)."""
    eng = RoutedEngine(
        *pair,
        ScriptedRouter(every=True),
        config=EngineConfig(
            num_slots=2048,
            clock=GpuClock(profile="h200-roofline"),
            scheduler=SchedulerConfig(max_running=4, min_large_batch=4),
            topology=topology,
        ),
    )
    eng.generate(make_prompts(4, seed=77, shared=20), 10)
    st = eng.stats
    assert st.escalations >= 30 and st.small_idle_s > 0  # it did wait for catch-ups
    assert st.device_idle_s <= st.host_s
    check_idle(eng)


def test_overlap_needs_the_tokencache_dispatch(pair: Any) -> None:
    with pytest.raises(ValueError, match="overlap=True needs dispatch='tokencache'"):
        RoutedEngine(
            *pair,
            EntropyRouter(1.0),
            config=EngineConfig(num_slots=256, dispatch="naive", overlap=True),
        )
    with pytest.raises(TypeError, match="overlap must be a bool"):
        EngineConfig(num_slots=256, overlap="yes")  # type: ignore[arg-type]
    assert not RoutedEngine(
        *pair, EntropyRouter(1.0), config=EngineConfig(num_slots=256, dispatch="naive")
    ).overlap


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_nothing_is_held_once_the_last_request_stopped(pair: Any, mode: str) -> None:
    """A lone request ending on a stop token leaves a row in the step launched after it:
    that step has nothing left to commit, so it is finished at once and its slot freed (no
    later iteration is needed to give it back)."""
    prompt = make_prompts(1, seed=76, shared=3)[0]
    ref, _ = reference_generate(*pair, [prompt], 8, lambda rid, pos: False)
    eng = RoutedEngine(
        *pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=256, mode=mode)
    )
    h = eng.submit(prompt, 8, stop_token_ids=[ref[0][3]])
    assert h.wait(60) and h.finished_reason == "stop"
    deadline = 100
    while not eng.idle_invariant() and mode == "threaded" and deadline:  # workers wind down
        deadline -= 1
        threading.Event().wait(0.02)
    assert eng.idle_invariant()
    if ref[0].index(ref[0][3]) == 3:  # it stopped there, its next row launched already
        assert eng.stats.dropped_rows == 1
    eng.shutdown()
