"""RoutedEngine.abort: an aborted request yields nothing more, its KV goes back (free or cached)
in both models, and every other request still equals the no-cache reference."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from routing_helpers import bernoulli_decide, make_prompts, no_worker_threads

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.core.scheduler_config import SchedulerConfig


def check_idle(eng: RoutedEngine) -> None:
    for side in eng.sides:
        assert side.pool.available + side.tree.total_size() == side.pool.num_slots
        assert side.tree.protected_size() == 0
        side.tree.check_invariants()
    assert no_worker_threads()


def check_others(
    pair: Any, decide: Any, prompts: list[list[int]], max_new: int, res: Any, aborted: dict
) -> None:
    """aborted: rid -> tokens it must have (a prefix of the reference); the rest are exact."""
    ref_tokens, ref_models = reference_generate(*pair, prompts, max_new, decide)
    for rid, (tok, mod) in enumerate(zip(res.tokens, res.models, strict=True)):
        if rid in aborted:
            assert tok == ref_tokens[rid][: aborted[rid]]
            assert res.finished_reasons[rid] == "abort"
        else:
            assert (tok, mod) == (ref_tokens[rid], ref_models[rid])
            assert res.finished_reasons[rid] == "length"


def consume(eng: RoutedEngine, prompts: list[list[int]], max_new: int, when: Any) -> Any:
    """Streams; after each event calls when(eng, tokens) -> rid to abort or None. Checks that
    no event of an aborted request follows the abort. Returns a generate-like result whose
    `cut` maps each aborted request to the tokens it got. The event loop stops between events,
    so every abort lands; threaded, the workers may finish the victim first (abort() then
    returns False and the request must end exactly as the reference)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    models: list[list[int]] = [[] for _ in prompts]
    cut: set[int] = set()
    tried: set[int] = set()
    for rid, tok, model in eng.stream(prompts, max_new):
        assert rid not in cut
        tokens[rid].append(tok)
        models[rid].append(model)
        victim = when(eng, tokens)
        if victim is not None and victim not in tried:
            tried.add(victim)
            if eng.abort(victim):
                cut.add(victim)
            else:
                assert eng.mode == "threaded", "an abort between events always lands"
    reasons = ["abort" if r in cut else "length" for r in range(len(prompts))]
    res = {"tokens": tokens, "models": models, "finished_reasons": reasons}
    res["cut"] = {r: len(tokens[r]) for r in cut}
    return type("Res", (), res)


MODES = [("tokencache", "events"), ("naive", "events"), ("tokencache", "threaded")]


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_abort_before_admission(pair: Any, dispatch: str, mode: str) -> None:
    router = ScriptedRouter({0: [1], 1: [2]})
    prompts = make_prompts(3, seed=50)
    sched = SchedulerConfig(max_running=1)
    eng = RoutedEngine(
        *pair,
        router,
        config=EngineConfig(num_slots=256, dispatch=dispatch, scheduler=sched, mode=mode),
    )
    res = consume(eng, prompts, 8, lambda e, t: 2)  # rid 0 decodes alone: 2 is not admitted
    assert res.tokens[2] == []
    assert eng.stats.aborted == 1
    check_others(pair, router.decide, prompts, 8, res, {2: 0})
    check_idle(eng)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_abort_mid_decode(pair: Any, dispatch: str, mode: str) -> None:
    router = ScriptedRouter({0: [1, 5], 1: [0, 6], 2: [4]})
    prompts = make_prompts(4, seed=51, shared=6)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode)
    )
    res = consume(eng, prompts, 10, lambda e, t: 1 if len(t[1]) == 3 else None)
    assert res.cut in ({1: 3}, {} if mode == "threaded" else {1: 3})
    check_others(pair, router.decide, prompts, 10, res, res.cut)
    check_idle(eng)


@pytest.mark.parametrize("dispatch", ["tokencache", "naive"])
def test_abort_while_parked(pair: Any, dispatch: str) -> None:
    router = ScriptedRouter({1: [3], 2: [1]})
    prompts = make_prompts(4, seed=52, shared=5)
    # Parked until 10 are or 100 steps pass, whatever holes it leaves (min_occupancy 0).
    sched = SchedulerConfig(min_large_batch=10, max_wait_steps=100, min_occupancy=0)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, dispatch=dispatch, scheduler=sched)
    )
    seen: list[bool] = []

    def when(e: RoutedEngine, t: list[list[int]]) -> int | None:
        if any(r.route_key == 1 for r in e.sched.parked):
            seen.append(True)
            return 1
        return None

    res = consume(eng, prompts, 10, when)
    assert seen
    check_others(pair, router.decide, prompts, 10, res, {1: 3})
    check_idle(eng)


def test_abort_while_catchup_in_flight(pair: Any) -> None:
    router = ScriptedRouter({1: [3], 3: [3]})
    prompts = make_prompts(4, seed=53, shared=5)
    eng = RoutedEngine(
        *pair,
        router,
        config=EngineConfig(num_slots=256, large_step_cost=5.0, topology="two-devices"),
    )
    seen: list[bool] = []

    def when(e: RoutedEngine, t: list[list[int]]) -> int | None:
        if any(r.route_key == 1 for r in e.sched.inflight):
            seen.append(True)
            return 1
        return None

    res = consume(eng, prompts, 10, when)
    assert seen  # the large token was delivered at launch, the request had not rejoined
    check_others(pair, router.decide, prompts, 10, res, {1: 4})
    check_idle(eng)


class _SignalRouter(ScriptedRouter):
    """Sets `parked` once request 0 has been escalated (called on the small worker)."""

    def __init__(self, positions: dict[int, list[int]]) -> None:
        super().__init__(positions)
        self.parked = threading.Event()

    def route(self, f: Any) -> Any:
        out = super().route(f)
        if any(r == 0 and e for r, e in zip(f.rids.tolist(), out.tolist(), strict=True)):
            self.parked.set()
        return out


def test_threaded_abort_queued_at_large_worker(pair: Any) -> None:
    # The large worker waits for 100 parked requests or 100 s while the small one is busy (and
    # ignores the hole the parked request leaves); the others' long generations give the
    # consumer thread ample time to abort before that.
    NEW = 300
    router = _SignalRouter({0: [2]})
    prompts = make_prompts(4, seed=54, shared=4)
    sched = SchedulerConfig(min_large_batch=100, max_wait_s=100.0, min_occupancy=0.0)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, scheduler=sched, mode="threaded")
    )
    res = consume(eng, prompts, NEW, lambda e, t: 0 if router.parked.is_set() else None)
    assert eng.stats.catchup_batch_sizes == []  # aborted before the large model ever ran
    assert eng.stats.aborted == 1
    # Tokens the small worker committed before the abort reached it may be dropped by the
    # stream (never delivered): what was delivered is a prefix of the first two.
    delivered = len(res.tokens[0])
    assert delivered <= 2
    check_others(pair, router.decide, prompts, NEW, res, {0: delivered})
    check_idle(eng)


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_abort_from_router_marks_generate_result(pair: Any, mode: str) -> None:
    holder: list[RoutedEngine] = []

    class AbortAt(ScriptedRouter):
        def route(self, f: Any) -> Any:
            for rid, pos in zip(f.rids.tolist(), f.positions.tolist(), strict=True):
                if rid == 1 and pos == 4:
                    assert holder[0].abort(1)
            return super().route(f)

    router = AbortAt({1: [2], 2: [0, 3]})
    prompts = make_prompts(3, seed=55)
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=256, mode=mode))
    holder.append(eng)
    res = eng.generate(prompts, 8)
    assert res.aborted == [False, True, False]
    # Threaded, tokens the small worker committed but the caller had not yet taken are dropped
    # with the abort, so fewer than 4 may have been delivered; the event loop delivers all 4,
    # or 3 with overlap: the router of position 4's step runs at its launch, before position
    # 3's step is finished, and nothing is delivered after abort() returned.
    delivered = len(res.tokens[1])
    assert delivered == (3 if eng.overlap else 4) if mode == "events" else delivered <= 4
    check_others(pair, router.decide, prompts, 8, res, {1: delivered})
    check_idle(eng)


@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize("num_slots", [512, 56])
def test_abort_many_bernoulli(pair: Any, mode: str, num_slots: int) -> None:
    router = BernoulliRouter(0.3, seed=5)
    prompts = make_prompts(7, seed=56, shared=8, lo=2, hi=7)
    sched = SchedulerConfig(max_running=5, min_large_batch=2, max_wait_steps=1, max_wait_s=0.002)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=num_slots, scheduler=sched, mode=mode)
    )
    plan = {3: 1, 10: 4, 25: 6}  # after the n-th event, abort this request

    def when(e: RoutedEngine, t: list[list[int]]) -> int | None:
        return plan.get(sum(map(len, t)))

    res = consume(eng, prompts, 12, when)
    assert set(res.cut) == set(plan.values()) or mode == "threaded"
    check_others(pair, bernoulli_decide(router), prompts, 12, res, res.cut)
    check_idle(eng)
    res2 = eng.generate(prompts[:3], 5)  # warm trees: still exact afterwards
    check_others(pair, bernoulli_decide(router), prompts[:3], 5, res2, {})
    check_idle(eng)


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_abort_unknown_or_finished(pair: Any, mode: str) -> None:
    router = ScriptedRouter({0: [1]})
    prompts = make_prompts(2, seed=57)
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=256, mode=mode))
    with pytest.raises(RuntimeError, match="no stream"):
        eng.abort(0)
    tokens: list[list[int]] = [[], []]
    for rid, tok, _ in eng.stream(prompts, 3):
        tokens[rid].append(tok)
        for bad in (2, -1, 99):
            with pytest.raises(ValueError, match="unknown request"):
                eng.abort(bad)
        if len(tokens[rid]) == 3:
            assert not eng.abort(rid)  # its last token was delivered: a no-op
    assert not eng.abort(0) and not eng.abort(1)  # the stream ended
    res = eng.generate(prompts, 3)
    assert res.finished_reasons == ["length", "length"] and res.tokens == tokens
    assert res.stats.aborted == 0
    check_idle(eng)
    # Long enough that the threaded workers cannot finish request 1 (6 tokens sometimes did)
    # before the abort, and short enough for the pool (256 slots).
    it = eng.stream(prompts, 100)
    next(it)
    assert eng.abort(1) and not eng.abort(1)  # twice: the second is a no-op
    it.close()


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_abort_refused_once_the_last_token_is_committed(pair: Any, mode: str) -> None:
    """Between a request's last token and its release a caller may already hold that token
    (a threaded stream races into this window): abort() there is a no-op, and the request
    ends by its own reason with every token."""
    eng = RoutedEngine(*pair, ScriptedRouter({}), config=EngineConfig(num_slots=256, mode=mode))
    in_window: list[bool] = []
    finish = eng.sched.finish

    def finish_with_a_late_abort(r: Any, reason: str, error: Any = None) -> None:
        if reason == "length":
            # The request's own handle (set when it was made): a threaded worker may get here
            # before submit() has returned it to this thread.
            in_window.append(r.handle.abort())
        finish(r, reason, error)

    eng.sched.finish = finish_with_a_late_abort  # type: ignore[method-assign]
    h = eng.submit(make_prompts(1, seed=58)[0], 3)
    assert h.wait(60)
    assert in_window == [False]
    assert h.finished_reason == "length" and len(h.tokens) == 3
    assert eng.stats.aborted == 0
    eng.shutdown()
    check_idle(eng)
