"""The online API: handles stream, wait and report; metrics agree with what was delivered."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import bernoulli_decide, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    SchedulerConfig,
    ScriptedRouter,
    reference_generate,
)


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_handles_iterate_listen_and_match_metrics(pair: Any, mode: str) -> None:
    router = BernoulliRouter(0.3, seed=21)
    eng = RoutedEngine(
        *pair,
        router,
        config=EngineConfig(num_slots=512, scheduler=SchedulerConfig(max_running=2), mode=mode),
    )
    prompts = make_prompts(5, seed=80, shared=4)
    seen: dict[int, int] = {}

    def listener(h: Any) -> None:
        new, models = h.tokens_since(seen.get(h.rid, 0))
        assert len(new) == len(models)
        seen[h.rid] = seen.get(h.rid, 0) + len(new)

    handles = [eng.submit(p, 7, route_key=i) for i, p in enumerate(prompts)]
    for h in handles:
        h.add_listener(listener)
    streamed = [list(h) for h in handles]  # blocking iteration drives or waits
    ref, ref_models = reference_generate(*pair, prompts, 7, bernoulli_decide(router))
    assert [[t for t, _ in s] for s in streamed] == ref
    assert [[m for _, m in s] for s in streamed] == ref_models
    assert all(seen[h.rid] == 7 for h in handles)  # every token reached the listener once
    assert all(len(h.token_times) == 7 for h in handles)
    m = eng.metrics()
    assert m["requests_submitted"] == m["requests_finished"] == 5
    assert m["tokens_generated"] == 35 and m["tokens_large"] == sum(map(sum, ref_models))
    assert m["requests_running"] == m["requests_waiting"] == 0
    for side in ("small", "large"):
        assert (
            m[f"{side}_kv_slots_free"] + m[f"{side}_kv_slots_used"] == m[f"{side}_kv_slots_total"]
        )
        assert m[f"{side}_kv_slots_used"] == m[f"{side}_kv_slots_cached"]  # idle: all cached
        assert m[f"{side}_kv_slots_pinned"] == 0
    assert 0 < m["small_batch_occupancy"] <= 1
    assert eng.idle_invariant()


def test_max_context_counts_positions_and_slots(pair: Any) -> None:
    small, _ = pair
    eng = RoutedEngine(*pair, BernoulliRouter(0.3), config=EngineConfig(num_slots=100_000))
    assert eng.max_context == small.config.max_position_embeddings
    with pytest.raises(ValueError, match="can never fit"):
        eng.submit([1] * eng.max_context, 1)
    h = eng.submit([1] * (eng.max_context - 4), 4)
    assert h.wait(120) and len(h.tokens) == 4
    assert eng.idle_invariant()


def test_wait_times_out_and_abort_stops(pair: Any) -> None:
    eng = RoutedEngine(
        *pair, BernoulliRouter(0.3), config=EngineConfig(num_slots=512, mode="threaded")
    )
    eng.start()
    h = eng.submit(make_prompts(1, seed=81)[0], 400)
    assert not h.wait(0.0) or h.done()
    assert h.abort() and not h.abort()
    assert h.wait(30) and h.finished_reason == "abort"
    eng.shutdown()
    assert eng.idle_invariant()


def test_model_devices_can_be_named(pair: Any) -> None:
    router = BernoulliRouter(0.3, seed=22)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, small_device="cpu", large_device="cpu")
    )
    assert eng.topology == "one-device"  # same device: catch-ups run between small steps
    assert eng.small.pool.device == eng.large.pool.device == eng.small.model.device
    prompts = make_prompts(3, seed=82)
    ref, _ = reference_generate(*pair, prompts, 5, bernoulli_decide(router))
    assert eng.generate(prompts, 5).tokens == ref
    with pytest.raises(ValueError, match="large_device"):
        EngineConfig(num_slots=256, large_device="no-such-device")


def test_router_is_swapped_through_the_engine(pair: Any) -> None:
    """RoutedEngine.router is the scheduler's: assigning it changes what the next steps ask."""
    first = BernoulliRouter(0.3, seed=23)
    eng = RoutedEngine(*pair, first, config=EngineConfig(num_slots=256))
    assert eng.router is first is eng.sched.router
    everything = ScriptedRouter(every=True)
    eng.router = everything
    assert eng.sched.router is everything
    res = eng.generate(make_prompts(2, seed=83), 4)
    assert all(m == [1] * 4 for m in res.models)  # every token escalated: the new router ran
