"""Failures lose nothing: an engine that fails, is interrupted or is misused releases every
slot and pin, says why, and the next generate is exact."""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any

import numpy as np
import pytest
from routing_helpers import (
    VOCAB,
    Flaky,
    FlakyModel,
    FlakyRouter,
    bernoulli_decide,
    check_exact,
    check_idle,
    make_prompts,
)

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    Router,
    SamplingParams,
    SchedulerConfig,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.core import batch as batch_module

MODES = [("tokencache", "events"), ("naive", "events"), ("tokencache", "threaded")]


def snapshot(eng: RoutedEngine) -> tuple[Any, ...]:
    sides = [(s.pool.available, s.cached_size(), s.pinned_size()) for s in eng.sides]
    return (*sides, eng.stats.tokens, eng.stats.steps, len(eng.sched.waiting))


# ---------------------------------------------------------------- item 1: concurrent callers


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_two_threads_generate_on_one_engine(pair: Any, dispatch: str, mode: str) -> None:
    router = BernoulliRouter(0.3, seed=3)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, dispatch=dispatch, mode=mode)
    )
    jobs = [make_prompts(4, seed=60, shared=5), make_prompts(3, seed=61)]
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = eng.generate(jobs[i], 9)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i, prompts in enumerate(jobs):
        ref, _ = reference_generate(*pair, prompts, 9, bernoulli_decide(router))
        assert results[i].tokens == ref
    check_idle(eng)


def test_submit_from_many_threads_with_background_driver(pair: Any) -> None:
    router = BernoulliRouter(0.2, seed=4)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, scheduler=SchedulerConfig(max_running=3))
    )
    eng.start()
    prompts = make_prompts(8, seed=62, shared=3)
    handles: list[Any] = [None] * len(prompts)

    def submit(i: int) -> None:
        handles[i] = eng.submit(prompts[i], 7, route_key=i)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(h.wait(60) for h in handles)
    ref, ref_models = reference_generate(*pair, prompts, 7, bernoulli_decide(router))
    assert [h.tokens for h in handles] == ref and [h.models for h in handles] == ref_models
    assert [h.finished_reason for h in handles] == ["length"] * len(prompts)
    eng.shutdown()
    check_idle(eng)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit(prompts[0], 3)


# ---------------------------------------------------------------- item 2: naive at page > 1


def test_naive_page_two_handoff_frees_the_partial_page(pair: Any) -> None:
    router = ScriptedRouter({0: [2]})
    prompt = make_prompts(1, seed=63, lo=7, hi=7)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=64, dispatch="naive", page_size=2)
    )
    res = eng.generate(prompt, 6)
    ref, _ = reference_generate(*pair, prompt, 6, router.decide)
    assert res.tokens == ref
    check_idle(eng)


@pytest.mark.parametrize("dispatch", ["naive", "tokencache"])
def test_page_four_small_pool_runs_to_the_end(pair: Any, dispatch: str) -> None:
    router = BernoulliRouter(0.2, seed=5)
    prompts = make_prompts(8, seed=64, lo=3, hi=8)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=64, dispatch=dispatch, page_size=4)
    )
    res = eng.generate(prompts, 30)
    ref, _ = reference_generate(*pair, prompts, 30, bernoulli_decide(router))
    assert res.tokens == ref
    check_idle(eng)


# ---------------------------------------------------------------- items 3-4: failures


@pytest.mark.parametrize("dispatch,mode", MODES)
@pytest.mark.parametrize("which", ["small", "large"])
def test_forward_error_releases_the_batch(pair: Any, dispatch: str, mode: str, which: str) -> None:
    small, large = pair
    router = BernoulliRouter(0.4, seed=6)
    boom = RuntimeError("forward failed")
    if which == "small":
        small = FlakyModel(small, lambda i: i == 3, boom)
    else:
        large = FlakyModel(large, lambda i: i == 1, boom)
    eng = RoutedEngine(
        small, large, router, config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode)
    )
    with pytest.raises(RuntimeError, match="forward failed"):
        eng.generate(make_prompts(4, seed=65, shared=3), 10)
    check_idle(eng)
    assert eng.stats.failed >= 1
    check_exact(eng, pair, router)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_router_error_releases_pins(pair: Any, dispatch: str, mode: str) -> None:
    inner = BernoulliRouter(0.3, seed=7)
    router = FlakyRouter(inner, lambda i: i == 4, ValueError("router failed"))
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode, page_size=4)
    )
    with pytest.raises(ValueError, match="router failed"):
        eng.generate(make_prompts(5, seed=66, shared=9), 12)
    check_idle(eng)
    eng.router = inner
    check_exact(eng, pair, inner)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_keyboard_interrupt_mid_stream(pair: Any, dispatch: str, mode: str) -> None:
    inner = BernoulliRouter(0.3, seed=8)
    router = FlakyRouter(inner, lambda i: i == 3, KeyboardInterrupt())
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode, page_size=4)
    )
    with pytest.raises(KeyboardInterrupt):
        eng.generate(make_prompts(5, seed=67, shared=6), 12)
    check_idle(eng)
    eng.router = inner
    check_exact(eng, pair, inner)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_allocator_memory_error_mid_stream(pair: Any, dispatch: str, mode: str) -> None:
    router = BernoulliRouter(0.3, seed=9)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode, page_size=4)
    )
    pool = eng.large.pool
    real = pool.alloc_array
    pool.alloc_array = Flaky(real, lambda i: i == 2, MemoryError("no memory"))  # type: ignore[method-assign]
    with pytest.raises(MemoryError, match="no memory"):
        eng.generate(make_prompts(5, seed=68, shared=6), 12)
    pool.alloc_array = real  # type: ignore[method-assign]
    check_idle(eng)
    check_exact(eng, pair, router)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_abandoned_stream_releases_everything(pair: Any, dispatch: str, mode: str) -> None:
    router = BernoulliRouter(0.3, seed=10)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode, page_size=4)
    )
    it = eng.stream(make_prompts(5, seed=69, shared=6), 20)
    for _ in range(7):
        next(it)
    it.close()
    check_idle(eng)
    check_exact(eng, pair, router)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_fault_injection_soak(pair: Any, dispatch: str, mode: str) -> None:
    """Forward, router and allocator fail at random steps over many seeded runs: after each
    run nothing leaks and a clean run is exact."""
    small, large = pair
    inner = BernoulliRouter(0.3, seed=11)
    for seed in range(6):
        rng = random.Random(seed)
        rates = [rng.choice([0.0, 0.1, 0.3]) for _ in range(4)]
        flaky_small = FlakyModel(small, lambda i, r=rates[0], g=rng: g.random() < r, OSError("s"))
        flaky_large = FlakyModel(large, lambda i, r=rates[1], g=rng: g.random() < r, OSError("l"))
        router = FlakyRouter(inner, lambda i, r=rates[2], g=rng: g.random() < r, OSError("r"))
        page = rng.choice([1, 2, 4])
        sched = SchedulerConfig(max_running=rng.choice([2, 4]), min_large_batch=2, max_wait_steps=1)
        eng = RoutedEngine(
            flaky_small,
            flaky_large,
            router,
            config=EngineConfig(
                num_slots=96, dispatch=dispatch, mode=mode, page_size=page, scheduler=sched
            ),
        )
        pool = eng.small.pool
        real = pool.alloc_array
        flaky = Flaky(real, lambda i, r=rates[3], g=rng: g.random() < r, MemoryError("a"))
        pool.alloc_array = flaky  # type: ignore[method-assign]
        prompts = make_prompts(6, seed=100 + seed, shared=5, lo=2, hi=9)
        with contextlib.suppress(OSError, MemoryError):
            eng.generate(prompts, 10)
        check_idle(eng)
        pool.alloc_array = real  # type: ignore[method-assign]
        flaky_small._call.when = flaky_large._call.when = router.call.when = lambda i: False
        check_exact(eng, pair, inner)


# ---------------------------------------------------------------- item 5: validation


@pytest.mark.parametrize(
    "prompts,max_new,error",
    [
        ([[1, 2], [3, 1.7]], 4, TypeError),  # floats are not token ids
        ([[1, 2], [3, VOCAB]], 4, ValueError),  # outside the vocabulary
        ([[1, 2], [-1]], 4, ValueError),
        ([[1, 2], []], 4, ValueError),
        ([[1, 2]], -1, ValueError),
        ([[1, 2]], 1.5, TypeError),
        ([[1, 2]], True, TypeError),
        ("hello", 4, TypeError),
        ([[1, 2], [3] * 300], 10, ValueError),  # can never fit a 256-slot pool
    ],
)
def test_bad_input_is_refused_before_any_work(
    pair: Any, prompts: Any, max_new: Any, error: type
) -> None:
    eng = RoutedEngine(*pair, BernoulliRouter(0.3), config=EngineConfig(num_slots=256))
    eng.generate([[4, 5, 6]], 3)  # warm trees
    before = snapshot(eng)
    with pytest.raises(error):
        eng.generate(prompts, max_new)
    assert snapshot(eng) == before
    check_idle(eng)


def test_submit_validates_sampling_and_stop_ids(pair: Any) -> None:
    eng = RoutedEngine(*pair, BernoulliRouter(0.3), config=EngineConfig(num_slots=256))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError):
        eng.submit([1, 2], 3, sampling={"temperature": 1.0})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        eng.submit([1, 2], 3, stop_token_ids=[VOCAB + 5])
    assert eng.metrics()["requests_submitted"] == 0
    h = eng.submit([1, 2], 0)
    assert h.done() and h.finished_reason == "length" and h.tokens == []


@pytest.mark.parametrize(
    "kw",
    [
        {"max_running": 0},
        {"max_running": -1},
        {"max_running": True},
        {"min_large_batch": 0},
        {"max_wait_steps": -1},
        {"max_large_batch": 0},
        {"max_wait_s": -0.5},
        {"max_wait_s": float("nan")},
        {"max_parked": -1},
    ],
)
def test_scheduler_config_refuses_values_that_would_hang(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="SchedulerConfig"):
        SchedulerConfig(**kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"num_slots": 0},
        {"large_num_slots": 0},
        {"num_slots": 2.5},
        {"page_size": 0},
        {"large_step_cost": 0},
        {"clock": "wall"},
        {"topology": "three-devices"},
    ],
)
def test_engine_config_is_checked(pair: Any, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RoutedEngine(*pair, BernoulliRouter(0.3), config=EngineConfig(**kw))


def test_abort_takes_an_index_not_a_bool(pair: Any) -> None:
    eng = RoutedEngine(*pair, ScriptedRouter(), config=EngineConfig(num_slots=256))
    it = eng.stream(make_prompts(2, seed=70), 5)
    next(it)
    with pytest.raises(TypeError):
        eng.abort(True)
    with pytest.raises(TypeError):
        eng.abort(1.0)  # type: ignore[arg-type]
    it.close()
    check_idle(eng)


@pytest.mark.parametrize(
    "answer", [lambda n: [False] * n, lambda n: np.zeros(n, dtype=bool), lambda n: [0] * n]
)
def test_router_may_answer_with_a_list_or_array(pair: Any, answer: Any) -> None:
    class ListRouter(Router):
        def route(self, f: Any) -> Any:
            return answer(len(f.rids))

    prompts = make_prompts(3, seed=71)
    eng = RoutedEngine(*pair, ListRouter(), config=EngineConfig(num_slots=256))
    res = eng.generate(prompts, 5)
    ref, _ = reference_generate(*pair, prompts, 5, lambda r, p: False)
    assert res.tokens == ref
    check_idle(eng)


@pytest.mark.parametrize("answer", [lambda n: [False] * (n + 1), lambda n: ["x"] * n])
def test_router_with_a_wrong_answer_is_refused_clearly(pair: Any, answer: Any) -> None:
    class BadRouter(Router):
        def route(self, f: Any) -> Any:
            return answer(len(f.rids))

    eng = RoutedEngine(*pair, BadRouter(), config=EngineConfig(num_slots=256))
    with pytest.raises((TypeError, ValueError), match="router answered"):
        eng.generate(make_prompts(3, seed=72), 5)
    check_idle(eng)


def test_sampling_is_reproducible_per_seed(pair: Any) -> None:
    eng = RoutedEngine(*pair, BernoulliRouter(0.3, seed=12), config=EngineConfig(num_slots=256))
    prompt = make_prompts(1, seed=73)[0]
    sp = SamplingParams(temperature=1.5, top_p=0.9, seed=1234)
    a = eng.submit(prompt, 12, sampling=sp, route_key=5)
    b = eng.submit(prompt, 12, sampling=sp, route_key=5)
    c = eng.submit(prompt, 12, sampling=SamplingParams(temperature=1.5, seed=99), route_key=5)
    for h in (a, b, c):
        assert h.wait(60)
    assert a.tokens == b.tokens and a.models == b.models
    assert a.tokens != c.tokens  # a 96-token vocabulary at temperature 1.5: seeds diverge
    router = BernoulliRouter(0.3, seed=12)
    greedy = eng.submit(prompt, 12, route_key=0)  # routed as request 0 of the reference
    assert greedy.wait(60)
    ref, ref_models = reference_generate(*pair, [prompt], 12, bernoulli_decide(router))
    assert greedy.tokens == ref[0] and greedy.models == ref_models[0]
    check_idle(eng)


# ---------------------------------------------------------------- finishing one request fails


class ReleaseFails:
    """Scheduler._release that raises for one route key the first time, after releasing (so
    nothing leaks and the test can check idle_invariant); every other call is the real one."""

    def __init__(self, sched: Any, key: int, error: Exception) -> None:
        self.real, self.key, self.error, self.raised = sched._release, key, error, False
        sched._release = self

    def __call__(self, r: Any) -> None:
        self.real(r)
        if r.route_key == self.key and not self.raised:
            self.raised = True
            raise self.error


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_release_error_ends_that_request_alone(pair: Any, dispatch: str, mode: str) -> None:
    """Three requests finish in one small step and the release of the middle one raises: it
    ends with that error (its tokens delivered), the other two end with theirs."""
    eng = RoutedEngine(
        *pair, ScriptedRouter({}), config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode)
    )
    boom = OSError("release failed")
    ReleaseFails(eng.sched, 1, boom)
    prompts = make_prompts(3, seed=80, lo=5, hi=5)
    handles = [eng.submit(p, 4, route_key=i) for i, p in enumerate(prompts)]
    assert all(h.wait(60) for h in handles)
    ref, _ = reference_generate(*pair, prompts, 4, lambda rid, pos: False)
    assert [h.tokens for h in handles] == ref
    assert [h.finished_reason for h in handles] == ["length", "error", "length"]
    assert handles[1].error is boom
    assert eng.stats.failed == 1
    assert eng.idle_invariant()  # check_exact checks the threads too, once generate joined
    check_exact(eng, pair, BernoulliRouter(0.0))


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_aborts_reach_the_batch_mates_of_a_failed_release(pair: Any, mode: str) -> None:
    """The batch-mates of a request whose release raised stay in the scheduler's lists: an
    abort made when that request ends (its listener, before the next step) reaches them,
    and so does shutdown()."""
    eng = RoutedEngine(*pair, ScriptedRouter({}), config=EngineConfig(num_slots=512, mode=mode))
    ReleaseFails(eng.sched, 1, OSError("release failed"))
    eng.start()
    prompts = make_prompts(4, seed=81, lo=5, hi=5)

    def abort_the_others(h: Any) -> None:
        if h.done():
            assert handles[0].abort() and handles[2].abort()

    with eng.sched.lock:  # the driver thread takes in all four together: one batch
        handles = [eng.submit(p, 3 if i == 1 else 200, route_key=i) for i, p in enumerate(prompts)]
        handles[1].add_listener(abort_the_others)
    for i in (0, 1, 2):
        assert handles[i].wait(60)
    eng.shutdown()  # request 3 (not in that batch's abort) ends here, or has just finished
    assert [h.finished_reason for h in handles[:3]] == ["abort", "error", "abort"]
    assert handles[3].done()
    check_idle(eng)
    ref, _ = reference_generate(*pair, prompts[:3], 5, lambda rid, pos: False)
    for i in (0, 2):
        got = handles[i].tokens
        assert 3 <= len(got) <= 4 and got == ref[i][: len(got)]


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_listener_error_ends_that_request_alone(pair: Any, dispatch: str, mode: str) -> None:
    eng = RoutedEngine(
        *pair,
        ScriptedRouter({1: [1], 2: [2]}),
        config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode),
    )
    prompts = make_prompts(3, seed=82)
    handles = [eng.submit(p, 8, route_key=i) for i, p in enumerate(prompts)]
    boom = ValueError("listener failed")
    calls: list[int] = []

    def listener(h: Any) -> None:
        calls.append(len(h.tokens))
        if len(calls) == 2:
            raise boom

    handles[1].add_listener(listener)
    assert all(h.wait(60) for h in handles)
    ref, ref_models = reference_generate(*pair, prompts, 8, ScriptedRouter({1: [1], 2: [2]}).decide)
    assert handles[1].finished_reason == "error" and handles[1].error is boom
    assert 1 <= len(handles[1].tokens) < 8 and handles[1].tokens == ref[1][: len(handles[1].tokens)]
    for i in (0, 2):
        assert handles[i].finished_reason == "length"
        assert (handles[i].tokens, handles[i].models) == (ref[i], ref_models[i])
    assert eng.idle_invariant()
    eng.router = BernoulliRouter(0.0)
    check_exact(eng, pair, eng.router)


# ---------------------------------------------------------------- preparing a step fails


@pytest.mark.parametrize("dispatch,mode", MODES)
@pytest.mark.parametrize("which", [0, 1])
def test_an_error_after_a_steps_allocation_frees_its_new_slots(
    pair: Any, dispatch: str, mode: str, which: int
) -> None:
    """prepare_forward allocates a step's new KV slots, then fills the slot table: an error
    there (here the table's scatter raises) fails the batch and gives those slots back too
    (they belonged to no handle yet: 22 small slots leaked before)."""
    router = BernoulliRouter(0.4, seed=6)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode)
    )
    table = eng.sides[which].table
    real = table.scatter
    table.scatter = Flaky(real, lambda i: i == 2, OSError("scatter failed"))  # type: ignore[method-assign]
    with pytest.raises(OSError, match="scatter failed"):
        eng.generate(make_prompts(4, seed=65, shared=3), 10)
    table.scatter = real  # type: ignore[method-assign]
    check_idle(eng)
    check_exact(eng, pair, router)


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_an_error_in_a_continued_steps_deferred_tokens_frees_its_new_slots(
    pair: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With overlap a step continuing the one in flight takes its input tokens from that
    step's draw (DeferredTokens), built after the new slots are allocated: an error there
    fails the batch and gives them back, and the step in flight is not left pointing at a
    step that never ran."""
    router = BernoulliRouter(0.4, seed=7)
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=256, mode=mode))
    assert eng.overlap
    cls = batch_module.DeferredTokens
    real = cls.of_rows
    flaky = Flaky(real, lambda i: i == 2, OSError("deferred tokens failed"))
    monkeypatch.setattr(cls, "of_rows", flaky)
    with pytest.raises(OSError, match="deferred tokens failed"):
        eng.generate(make_prompts(4, seed=66, shared=3), 10)
    monkeypatch.setattr(cls, "of_rows", real)
    check_idle(eng)
    check_exact(eng, pair, router)
