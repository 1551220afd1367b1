"""Scheduler promises that mutation testing (docs/MUTATION.md) found unpinned: each test here
fails with the mutant it names planted in the scheduler (its modules: core/scheduler.py's
docstring lists them).
Most drive a Scheduler directly, on stand-in KV handles (no model, no forward)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from routing_helpers import bernoulli_decide, check_exact, check_idle, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    SamplingParams,
    ScriptedRouter,
)
from tokencache_routing.core.admission import WaitForMemory
from tokencache_routing.core.batch import PreparedForward
from tokencache_routing.core.kv import CursorKV
from tokencache_routing.core.routers import Router, RouterFeatures
from tokencache_routing.core.scheduler import Scheduler
from tokencache_routing.core.scheduler_config import SchedulerConfig
from tokencache_routing.core.state import GREEDY, LARGE, Request


class Handle:
    """A stand-in KV handle: release() counts its calls; release() or park() raises `error`
    once when given one."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.released = error, 0
        self.attached, self.length = False, 0  # no KV yet (a first forward in its model)

    def release(self, seq: Any) -> None:
        self.released += 1
        self._raise()

    def park(self, seq: Any) -> None:
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def request(rid: int, prompt_len: int = 4, max_new: int = 8) -> Request:
    r = Request(rid, rid, np.arange(prompt_len) + 10 * rid, max_new, GREEDY, frozenset())
    r.kv = [Handle(), Handle()]
    r.admit_order = rid
    return r


class Side:
    """A stand-in model side for hold-backs: a page size and an empty cache."""

    page_size = 1

    def cached_prefix_len(self, tokens: Any) -> int:
        return 0


def scheduler(**cfg: Any) -> Scheduler:
    return Scheduler((None, None), SchedulerConfig(**cfg), None, None, False, False)  # type: ignore[arg-type]


# ---------------------------------------------------------------- SchedulerConfig


@pytest.mark.parametrize(
    "field,lo",
    [
        ("max_running", 1),
        ("chunked_prefill_size", 0),
        ("large_chunked_prefill_size", 0),
        ("min_large_batch", 1),
        ("max_wait_steps", 0),
        ("max_large_batch", 1),
        ("max_parked", 0),
    ],
)
def test_each_int_knob_takes_its_least_value_and_refuses_one_less(field: str, lo: int) -> None:
    """__post_init__: the least value allowed is accepted, one less refused with an error that
    names the field and the bound (mutants 16, 36: the field misnamed; 56: max_large_batch=1
    refused)."""
    assert getattr(SchedulerConfig(**{field: lo}), field) == lo
    message = rf"^SchedulerConfig\.{field} must be an int >= {lo}, got {lo - 1}$"
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{field: lo - 1})


# ---------------------------------------------------------------- launch_due


def test_a_catchup_split_in_chunks_goes_on_at_once() -> None:
    """launch_due: a parked request whose catch-up chunk stopped short is due whatever the
    launch rules say (here: a full small batch, min_large_batch not reached); and the caller's
    waited_out is honoured (mutant 3: waited_out = None)."""
    s = scheduler(max_running=4, min_large_batch=4, max_wait_steps=100, min_occupancy=0.8)
    s.running = [request(i) for i in range(4)]
    parked = request(4)
    s.parked = [parked]
    assert not s.launch_due(False, False)  # 1 < 4 parked, a full batch: it waits
    assert s.launch_due(True, False)  # the oldest waited out
    parked.partial_prefill = True
    assert s.launch_due(False, False)


# ---------------------------------------------------------------- _release, finish, fail, _each


def test_a_release_that_raises_releases_the_other_model_and_ends_the_request_with_it() -> None:
    """_release: one model's release raises; the other model's KV is released all the same
    and the error propagates, so finish ends the request with it (mutant 3: `first = None`
    swallowed it: the request ended by length, its error unreported)."""
    s = scheduler()
    r = request(0)
    boom = OSError("release failed")
    r.kv[0] = Handle(boom)
    s.running = [r]
    s.finish(r, "length")
    assert r.finished_reason == "error" and r.error is boom
    assert [h.released for h in r.kv] == [1, 1]
    assert s.running == [] and s.stats.failed == 1


def test_a_release_error_outranks_an_earlier_recorded_failure() -> None:
    """finish: a request whose failure was recorded (a listener raised: r.failure) and whose
    KV release then raises ends with the release's error, the one its end met (the mutant
    `reason != "XXerrorXX"` put the recorded failure back)."""
    s = scheduler()
    r = request(0)
    r.failure = ValueError("listener failed")
    r.abort_requested = True
    boom = OSError("release failed")
    r.kv[0] = Handle(boom)
    s.running = [r]
    s.finish(r, "abort")
    assert r.finished_reason == "error" and r.error is boom
    q = request(1)  # without a release error, the recorded failure is its end
    q.failure = failure = ValueError("listener failed")
    s.running = [q]
    s.finish(q, "abort")
    assert q.finished_reason == "error" and q.error is failure
    assert s.stats.failed == 2


def test_an_aborted_request_that_fails_ends_with_its_error() -> None:
    """finish: a request whose abort was asked for and that then fails ends "error" with its
    error, not "abort" (mutant 18: `reason != "ERROR"` made it an abort)."""
    s = scheduler()
    r = request(0)
    r.abort_requested = True
    boom = RuntimeError("forward failed")
    s.running = [r]
    s.finish(r, "error", boom)
    assert r.finished_reason == "error" and r.error is boom
    assert (s.stats.failed, s.stats.aborted) == (1, 0)
    q = request(1)
    q.abort_requested = True
    s.finish(q, "length")
    assert q.finished_reason == "abort" and q.error is None
    assert (s.stats.failed, s.stats.aborted, s.stats.finished) == (1, 1, 2)
    a = request(2)  # a second abort is counted too (the mutant `aborted = 1` counted one)
    a.abort_requested = True
    s.finish(a, "length")
    assert (s.stats.failed, s.stats.aborted, s.stats.finished) == (1, 2, 3)


def test_fail_re_raises_an_interrupt_once_the_whole_batch_ended() -> None:
    """fail: ending one request is interrupted (its release raises KeyboardInterrupt); the
    others end all the same and the interrupt is re-raised after (mutant 12: `interrupt and
    e` swallowed it)."""
    s = scheduler()
    batch = [request(i) for i in range(3)]
    batch[1].kv[0] = Handle(KeyboardInterrupt())
    s.running = list(batch)
    boom = RuntimeError("forward failed")
    with pytest.raises(KeyboardInterrupt):
        s.fail(batch, boom)
    assert [r.finished_reason for r in batch] == ["error", "error", "error"]
    assert batch[0].error is boom and batch[2].error is boom
    assert all(h.released == 1 for r in batch for h in r.kv)
    assert s.running == [] and s.stats.failed == 3


def test_each_ends_a_raising_row_alone_with_its_error() -> None:
    """_each: a step that raises ends that request with the error it raised (mutant 9: with
    None), the others go on."""
    s = scheduler()
    batch = [request(i) for i in range(3)]
    s.running = list(batch)
    boom = ValueError("row 1")
    seen: list[int] = []

    def step(i: int, r: Request) -> None:
        seen.append(i)
        if i == 1:
            raise boom

    s._each(batch, step)
    assert seen == [0, 1, 2]
    assert [r.finished_reason for r in batch] == [None, "error", None]
    assert batch[1].error is boom
    assert s.running == [batch[0], batch[2]]


def test_each_ends_the_rest_of_the_batch_on_an_interrupt_then_re_raises_it() -> None:
    """_each: an interrupt in one row's step ends that row and every row after it, with the
    interrupt, and then propagates (mutant 14: `self.fail(e)`, a TypeError instead)."""
    s = scheduler()
    batch = [request(i) for i in range(4)]
    s.running = list(batch)
    stop = KeyboardInterrupt()

    def step(i: int, r: Request) -> None:
        if i == 1:
            raise stop

    with pytest.raises(KeyboardInterrupt) as caught:
        s._each(batch, step)
    assert caught.value is stop
    assert [r.finished_reason for r in batch] == [None, "error", "error", "error"]
    assert all(r.error is stop for r in batch[1:])
    assert s.running == [batch[0]]


# ---------------------------------------------------------------- admit


def test_admission_counts_each_request_it_holds_back() -> None:
    """admit with hold-back: two requests sharing the whole prompt of one admitted before
    them, not prefilled yet, are held back, each counted once, and stay first in line
    (mutant 28: `held_back = 1`)."""
    s = Scheduler((Side(), Side()), SchedulerConfig(), None, lambda side: Handle(), False, True)  # type: ignore[arg-type]
    a, b, c, d = (request(i) for i in range(4))
    for r in (b, c):
        r.seq[:] = a.seq
    for r in (a, b, c, d):
        r.admit_order = -1
        s.add(r)
    s.admit()
    assert s.running == [a, d] and list(s.waiting) == [b, c]
    assert s.stats.held_back == 2
    assert [r.admit_order for r in (a, b, c, d)] == [0, -1, -1, 1]


def test_a_catchup_waiting_for_memory_leaves_the_parked_list_as_it_was() -> None:
    """schedule_large: a catch-up whose allocation must wait for memory (WaitForMemory) puts
    its batch back in front of the parked list, in order, and unholds the requests it held
    back (mutant 32: `batch - self.parked`, a TypeError instead)."""
    s = Scheduler((Side(), Side()), SchedulerConfig(), None, None, False, False)  # type: ignore[arg-type]
    parked = [request(i) for i in range(3)]
    parked[2].seq[:] = parked[0].seq  # shares its whole prompt with request 0: held back
    s.parked = list(parked)
    tried: list[list[int]] = []

    def prepare(batch: list[Request], kind: int, deferred: list[Request]) -> None:
        tried.append([r.rid for r in batch])
        raise WaitForMemory

    s._prepare = prepare  # type: ignore[assignment,method-assign]
    with pytest.raises(WaitForMemory):
        s.schedule_large()
    assert tried == [[0, 1]]
    assert s.parked == parked
    assert not any(r.held_catchup for r in parked)


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_a_catchup_whose_commit_raises_ends_its_batch_with_that_error(
    pair: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finish_large: the catch-up's commit raises: its requests end with that error, their KV
    released, and the engine runs exactly after (mutant 20: `self.abandon(e)`, a TypeError
    out of finish_large instead)."""
    router = BernoulliRouter(0.4, seed=6)
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=256, mode=mode))
    boom = OSError("catch-up commit failed")
    real = PreparedForward.commit
    raised: list[bool] = []

    def commit(prep: PreparedForward, live: Any = None) -> None:
        if prep.side is eng.sides[LARGE] and not raised:
            raised.append(True)
            raise boom
        real(prep, live)

    monkeypatch.setattr(PreparedForward, "commit", commit)
    with pytest.raises(OSError, match="catch-up commit failed"):
        eng.generate(make_prompts(4, seed=65, shared=3), 10)
    assert raised and eng.stats.failed >= 1
    monkeypatch.setattr(PreparedForward, "commit", real)
    check_idle(eng)
    check_exact(eng, pair, router)


class Drawn:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def resolve(self, batch: Any) -> tuple[list[int], dict[int, BaseException]]:
        return self.tokens, {}


class CatchUp:
    """A stand-in catch-up forward (PreparedForward's fields finish_large reads), launched."""

    def __init__(self, batch: list[Request], tokens: list[int]) -> None:
        n = len(batch)
        self.batch, self.drawn, self.side = batch, Drawn(tokens), None
        self.incomplete, self.kv_lens = np.zeros(n, np.bool_), np.full(n, 4, np.int64)
        self.any_incomplete = False
        self.num_tokens, self.shared_prefix = 4 * n, None

    def commit(self) -> None:
        pass


def test_an_interrupt_in_a_catchup_keeps_the_running_list() -> None:
    """finish_large: an interrupt while committing a catch-up's tokens ends the rest of its
    batch and propagates; the requests it already handed back join the running list, next to
    those already there (mutant 45: `self.running = back` dropped those)."""
    s = scheduler()
    other = request(9)
    s.running = [other]
    batch = [request(i) for i in range(3)]
    batch[1].kv[LARGE] = Handle(KeyboardInterrupt())  # its park() is interrupted
    for r in batch:
        r.busy_model = LARGE
    s.busy = list(batch)
    with pytest.raises(KeyboardInterrupt):
        s.finish_large(CatchUp(batch, [5, 6, 7]), None, 0.0)  # type: ignore[arg-type]
    assert s.running == [other, batch[0]]
    assert batch[0].tokens == [5] and batch[0].finished_reason is None
    assert [r.finished_reason for r in batch[1:]] == ["error", "error"]
    assert s.busy == []


class TokenReadingRouter(Router):
    """A Bernoulli draw, or the small model's token a multiple of 5: reads every feature the
    engine hands a router (rids, positions and the drawn tokens)."""

    def __init__(self) -> None:
        self.inner = BernoulliRouter(0.3, seed=6)

    def route(self, f: RouterFeatures) -> torch.Tensor:
        return self.inner.route(f) | (f.tokens % 5 == 0)


def run_only(prep: PreparedForward, router: Any = None) -> float:
    """PreparedForward.launch without the draw and the routing: finish_small / finish_large
    then draw (and route) on the host, their `run() rather than launch()` path."""
    prep.out, dt = prep.run()
    return dt


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_forwards_run_without_launch_draw_and_route_as_launched_ones(
    pair: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finish_small and finish_large draw (and route) a forward that was run() rather than
    launch()ed as launch() would: the same tokens, models and finish reasons, sampled rows
    and greedy ones mixed (finish_large mutants 10, 15: the draw without its rows' places
    or without which rows sample; finish_small 94: the router handed no tokens)."""
    prompts = make_prompts(6, seed=91, shared=3)
    sampled = [SamplingParams(temperature=1.2, top_p=0.9, seed=70 + i) for i in range(6)]
    sampling = [sampled[i] if i % 2 else GREEDY for i in range(6)]

    def generate() -> list[Any]:
        # No overlap: a step continuing one in flight reads that one's draw on the device.
        eng = RoutedEngine(
            *pair,
            TokenReadingRouter(),
            config=EngineConfig(num_slots=256, mode=mode, overlap=False),
        )
        handles = [
            eng.submit(p, 10, route_key=i, sampling=sampling[i]) for i, p in enumerate(prompts)
        ]
        assert all(h.wait(60) for h in handles)
        eng.shutdown()
        check_idle(eng)
        assert eng.stats.escalations > 0
        return [(h.tokens, h.models, h.finished_reason) for h in handles]

    launched = generate()
    monkeypatch.setattr(PreparedForward, "launch", run_only)
    assert generate() == launched


class NaNModel:
    """A model whose forwards from call `at` on answer NaN logits (everything else delegated)."""

    def __init__(self, model: Any, at: int) -> None:
        self._model, self.at, self.calls = model, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._model(*a, **k)

    def execute(self, *a: Any, **k: Any) -> Any:
        out = self._model.execute(*a, **k)
        self.calls += 1
        if self.calls > self.at:
            out = dataclasses.replace(out, logits=torch.full_like(out.logits, float("nan")))
        return out


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_a_row_that_cannot_be_sampled_ends_alone(pair: Any, mode: str) -> None:
    """finish_small: the small steps answer NaN logits from the third on; the sampled request
    of the batch cannot be sampled and ends alone with a FloatingPointError naming it, the
    greedy one goes on to its length (mutants 101: `drawn.resolve(None)`, 151:
    `self.fail(e)`: a TypeError, out of the step or ending the whole batch)."""
    small, large = pair
    eng = RoutedEngine(
        NaNModel(small, 2), large, ScriptedRouter({}), config=EngineConfig(num_slots=256, mode=mode)
    )
    prompts = make_prompts(2, seed=93, lo=5, hi=5)
    sampled = SamplingParams(temperature=1.0, seed=5)
    greedy = eng.submit(prompts[0], 8, route_key=0)
    other = eng.submit(prompts[1], 8, route_key=1, sampling=sampled)
    assert greedy.wait(60) and other.wait(60)
    eng.shutdown()
    assert greedy.finished_reason == "length" and len(greedy.tokens) == 8
    assert other.finished_reason == "error"
    assert isinstance(other.error, FloatingPointError)
    assert f"request {other.rid}:" in str(other.error)
    assert eng.stats.failed == 1
    check_idle(eng)


def test_the_step_counter_counts_small_steps(pair: Any) -> None:
    """finish_small: stats.steps counts the small steps, one each (mutant 36: counted down)."""
    eng = RoutedEngine(*pair, BernoulliRouter(0.3, seed=6), config=EngineConfig(num_slots=256))
    eng.generate(make_prompts(4, seed=94), 7)
    assert eng.stats.steps == len(eng.stats.small_batch_sizes) >= 7


# ---------------------------------------------------------------- commit_token


def test_the_token_counters_count_each_delivered_token_once(pair: Any) -> None:
    """commit_token: stats.tokens counts every delivered token once, stats.large_tokens those
    the large model gave (mutant 9: `tokens += 2`)."""
    eng = RoutedEngine(*pair, BernoulliRouter(0.4, seed=6), config=EngineConfig(num_slots=256))
    res = eng.generate(make_prompts(5, seed=92, shared=3), 9)
    models = [m for ms in res.models for m in ms]
    assert eng.stats.tokens == sum(len(t) for t in res.tokens) == len(models) == 45
    assert eng.stats.large_tokens == models.count(LARGE) > 0


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_an_interrupt_while_a_small_step_ends_its_requests_ends_the_rest(
    pair: Any, mode: str
) -> None:
    """finish_small: three requests take their last token in one small step and the release
    of the second is interrupted (KeyboardInterrupt, after releasing): the first two end by
    their length (their tokens delivered), the third ends with the interrupt before its last
    token, and the interrupt propagates: out of the event loop's wait, or ending the threaded
    driver's worker (mutant 156: `self.fail(e)`, a TypeError instead, the third left
    unfinished)."""
    eng = RoutedEngine(*pair, ScriptedRouter({}), config=EngineConfig(num_slots=256, mode=mode))
    stop = KeyboardInterrupt()
    real, raised = eng.sched._release, []

    def release(r: Request) -> None:
        real(r)
        if r.route_key == 1 and not raised:
            raised.append(r)
            raise stop

    eng.sched._release = release  # type: ignore[method-assign]
    prompts = make_prompts(3, seed=80, lo=5, hi=5)
    with eng.sched.lock:  # one batch: the driver takes in all three together (threaded: it
        # starts at the first submit, and stepped that one alone when the machine was busy)
        handles = [eng.submit(p, 4, route_key=i) for i, p in enumerate(prompts)]
    interrupted = False
    try:
        for h in handles:
            assert h.wait(60)
    except KeyboardInterrupt as e:
        interrupted = e is stop
    assert interrupted == (mode == "events")
    eng.sched._release = real  # type: ignore[method-assign]
    assert [h.finished_reason for h in handles] == ["length", "length", "error"]
    assert [len(h.tokens) for h in handles] == [4, 4, 3]
    assert handles[2].error is stop
    eng.shutdown()
    check_idle(eng)


def _interrupted_while_waiting(handles: list[Any], stop: BaseException) -> bool:
    """Waits for `handles`; True when `stop` reached the caller meanwhile (the event loop
    runs in the waiting thread, so an interrupt inside a step propagates there)."""
    try:
        for h in handles:
            assert h.wait(60)
    except KeyboardInterrupt as e:
        return e is stop
    return False


class _TrapSeq(np.ndarray):
    """A request's token array whose write at one place raises `error` (once)."""

    trap_at: int
    error: BaseException | None

    def __setitem__(self, key: Any, value: Any) -> None:
        if key == self.trap_at and self.error is not None:
            error, self.error = self.error, None
            raise error
        super().__setitem__(key, value)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_an_interrupt_while_a_small_step_delivers_leaves_no_request_behind(
    pair: Any, mode: str, overlap: bool
) -> None:
    """finish_small delivers a step's tokens in one pass: an interrupt while the second of
    three rows takes its token ends it and the third with that error; the first, which took
    its token, goes on in the scheduler's lists: shutdown ends it, nothing leaks (a pass that
    forgot the rows it handled before the interrupt left them in no list, never ending;
    with overlap the first goes on in the step launched after, without it in the running
    list)."""
    eng = RoutedEngine(
        *pair, ScriptedRouter({}), config=EngineConfig(num_slots=256, mode=mode, overlap=overlap)
    )
    stop = KeyboardInterrupt()
    prompts = make_prompts(3, seed=83, lo=5, hi=5)
    with eng.sched.lock:  # one batch: the driver takes in all three together
        handles = [eng.submit(p, 40, route_key=i) for i, p in enumerate(prompts)]
        req = handles[1]._req
        trap = req.seq.view(_TrapSeq)
        trap.trap_at, trap.error = req.prompt_len + 2, stop
        req.seq = trap
    assert _interrupted_while_waiting(handles[1:], stop) == (mode == "events")
    assert [h.finished_reason for h in handles[1:]] == ["error", "error"]
    assert [len(h.tokens) for h in handles[1:]] == [2, 2]
    assert not handles[0].done() or handles[0].finished_reason == "error"
    eng.shutdown()
    assert handles[0].done()
    check_idle(eng)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_an_interrupt_while_a_small_step_parks_leaves_no_request_behind(
    pair: Any, mode: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finish_small's park pass: three of four rows escalate at the same step and the second
    one's park is interrupted. The first, parked already, stays parked; the second and third,
    not parked yet, and the fourth, whose token was not delivered yet, end with that error
    (mutants of the sampled finish_small run: 193, a pass index off by one, left the rows
    after the interrupt in no list, never ending; 283 failed the row parked before it too)."""
    router = ScriptedRouter({0: [2], 1: [2], 2: [2]})
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, mode=mode, overlap=overlap)
    )
    stop = KeyboardInterrupt()
    prompts = make_prompts(4, seed=89, lo=5, hi=5)
    park = CursorKV.park
    trapped: list[np.ndarray] = []

    def interrupted_park(self: CursorKV, seq: np.ndarray) -> None:
        if trapped and seq is trapped[0]:  # the second request's small-model park, once
            trapped.clear()
            raise stop
        park(self, seq)

    monkeypatch.setattr(CursorKV, "park", interrupted_park)
    with eng.sched.lock:  # one batch: the driver takes in all four together
        handles = [eng.submit(p, 40, route_key=i) for i, p in enumerate(prompts)]
        trapped.append(handles[1]._req.seq)
    assert _interrupted_while_waiting(handles[1:], stop) == (mode == "events")
    assert [h.finished_reason for h in handles[1:]] == ["error"] * 3
    assert [len(h.tokens) for h in handles[1:]] == [2, 2, 2]
    if mode == "events":  # parked before the interrupt: still on a list, not failed with it
        assert handles[0].finished_reason is None and handles[0]._req in eng.sched.active()
    else:  # an interrupt escaping a worker fails every request (ThreadedDriver._guard)
        assert handles[0].finished_reason == "error"
    eng.shutdown()
    assert handles[0].done()
    check_idle(eng)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_a_request_with_its_own_lock_takes_its_tokens_like_the_others(
    pair: Any, mode: str, overlap: bool
) -> None:
    """A small step delivers under the engine's shared delivery lock; a request that keeps
    its own lock (made outside an engine) takes its tokens under that one instead, the same
    tokens (mutant 247 of the sampled finish_small run, a wrong call on that path, ended such
    a request with an error)."""
    from tokencache_routing import reference_generate

    router = BernoulliRouter(0.2, seed=97)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=256, mode=mode, overlap=overlap)
    )
    prompts = make_prompts(3, seed=97, lo=5, hi=5)
    with eng.sched.lock:  # replaced before any step delivers to it
        handles = [eng.submit(p, 8, route_key=i) for i, p in enumerate(prompts)]
        own = handles[1]._req
        own.lock = type(own.lock)()
        assert own.lock is not eng.sched.delivery_lock
    assert all(h.wait(60) for h in handles)
    ref, _ = reference_generate(*pair, prompts, 8, bernoulli_decide(router))
    assert [h.finished_reason for h in handles] == ["length"] * 3
    assert [list(h.tokens) for h in handles] == ref
    eng.shutdown()
    check_idle(eng)
