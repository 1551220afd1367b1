"""Chunked prefill (SchedulerConfig.chunked_prefill_size / large_chunked_prefill_size): a long
prompt or a long catch-up is split across steps under a per-step token budget, decode rows go
first, and the routed output still equals the no-cache reference; nothing leaks when a request
fails, is aborted or preempted between its chunks."""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_helpers import VOCAB, make_prompts
from test_exactness import bernoulli_decide
from test_failures import Flaky, FlakyModel, check_exact, check_idle

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    EntropyRouter,
    RoutedEngine,
    SchedulerConfig,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.core.batch import chunk_ends
from tokencache_routing.core.state import GREEDY, Request

SMALL, LARGE = 0, 1
MODES = [("tokencache", "events"), ("naive", "events"), ("tokencache", "threaded")]


class Recorder:
    """Records every forward the scheduler commits: per model, (rids, tokens per row, rows
    whose chunk stopped short), and checks the parked/busy rules of split catch-ups."""

    def __init__(self, eng: RoutedEngine) -> None:
        self.eng = eng
        self.forwards: list[tuple[int, list[int], list[int], list[int]]] = []
        self.violations: list[str] = []
        self.open: set[int] = set()  # rids whose catch-up has run some chunks, not the last
        s = eng.sched
        inner_small, inner_large = s.finish_small, s.finish_large
        inner_schedule = s.schedule_small
        self.schedules = 0

        def schedule_small(after: Any = None) -> Any:  # no progress: fails, not hangs
            self.schedules += 1
            if self.schedules > 20_000:
                raise RuntimeError("the small model's scheduler spins without progress")
            return inner_schedule(after)

        def finish_small(prep: Any, out: Any, now: float) -> Any:
            self._record(SMALL, prep)
            return inner_small(prep, out, now)

        def finish_large(prep: Any, out: Any, now: float) -> Any:
            self._record(LARGE, prep)
            back = inner_large(prep, out, now)
            for r in prep.batch:
                if r.partial_prefill and (r in back or r in s.running or r not in s.parked):
                    self.violations.append(f"rid {r.rid}: left the catch-up mid-chunk")
            short = {r.rid for r, inc in zip(prep.batch, prep.incomplete, strict=True) if inc}
            self.open = (self.open | short) - {r.rid for r in prep.batch if r.rid not in short}
            return back

        inner_preempt = s.preempt

        def preempt(r: Any) -> None:  # its KV is dropped: it starts over, no catch-up open
            self.open.discard(r.rid)
            inner_preempt(r)

        s.finish_small, s.finish_large = finish_small, finish_large  # type: ignore[method-assign]
        s.schedule_small = schedule_small  # type: ignore[method-assign]
        s.preempt = preempt  # type: ignore[method-assign]

    def _record(self, kind: int, prep: Any) -> None:
        # Rows dropped from an overlapped step (their request parked or ended at the one
        # before) are computed and never committed: not counted as stepped.
        keep = [i for i in range(len(prep.batch)) if i not in prep.dropped]
        rids = [prep.batch[i].rid for i in keep]
        q = np.diff(prep.q_off)[keep].tolist()
        short = [prep.batch[i].rid for i in keep if prep.incomplete[i]]
        if kind == SMALL:  # a catch-up not finished keeps its request off the small side
            self.violations += [f"rid {i}: stepped mid catch-up" for i in rids if i in self.open]
        self.forwards.append((kind, rids, q, short))

    def tokens(self, kind: int) -> list[int]:
        return [sum(q) for k, _, q, _ in self.forwards if k == kind]


def run_checked(
    pair: Any,
    router: Any,
    decide: Any,
    prompts: list[list[int]],
    max_new: int,
    budget: int,
    large_budget: int | None = None,
    **kw: Any,
) -> tuple[RoutedEngine, Any, Recorder]:
    small, large = pair
    sched = kw.pop("scheduler", None) or SchedulerConfig(max_running=3)
    sched = SchedulerConfig(
        **{
            **{f: getattr(sched, f) for f in sched.__dataclass_fields__},
            "chunked_prefill_size": budget,
            "large_chunked_prefill_size": large_budget,
        }
    )
    eng = RoutedEngine(small, large, router, config=EngineConfig(scheduler=sched, **kw))
    rec = Recorder(eng)
    res = eng.generate(prompts, max_new)
    ref_tokens, ref_models = reference_generate(small, large, prompts, max_new, decide)
    assert res.tokens == ref_tokens
    assert res.models == ref_models
    check_idle(eng)
    assert not rec.violations, rec.violations
    for kind, cap in ((SMALL, budget), (LARGE, budget if large_budget is None else large_budget)):
        if cap:
            assert max(rec.tokens(kind), default=0) <= cap
    return eng, res, rec


# ---------------------------------------------------------------- chunk selection


def _req(rid: int, n: int, length: int) -> Request:
    r = Request(rid, rid, np.arange(n, dtype=np.int64) % VOCAB, 4, GREEDY, frozenset())

    class H:
        attached = True

    h = H()
    h.length = length  # type: ignore[attr-defined]
    r.kv = [h, h]  # type: ignore[list-item]
    return r


def test_chunk_ends_decode_first_then_prefills_in_order() -> None:
    batch = [_req(0, 50, 0), _req(1, 10, 9), _req(2, 30, 20), _req(3, 8, 7)]
    assert chunk_ends(batch, SMALL, 0) == [50, 10, 30, 8]  # no budget
    assert chunk_ends(batch, SMALL, 3) == [1, 10, 20, 8]  # decode rows, then prefills
    assert chunk_ends(batch, SMALL, 12) == [10, 10, 20, 8]  # then the first prefill's chunk
    assert chunk_ends(batch, SMALL, 60) == [50, 10, 28, 8]  # the budget runs out in the second
    assert chunk_ends(batch, SMALL, 100) == [50, 10, 30, 8]
    # Decode rows alone would fill the budget: one token is kept for the first prefill.
    assert chunk_ends(batch, SMALL, 1) == [1, 9, 20, 7]
    assert chunk_ends(batch, SMALL, 2) == [1, 10, 20, 7]
    many = [_req(i, 5, 4) for i in range(4)]
    assert chunk_ends(many, SMALL, 3) == [5, 5, 5, 4]  # decode rows only: the first three
    assert chunk_ends([*many, _req(9, 40, 0)], SMALL, 3) == [5, 5, 4, 4, 1]


def test_config_validates_the_budget() -> None:
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=-1)
    with pytest.raises(ValueError, match="large_chunked_prefill_size"):
        SchedulerConfig(large_chunked_prefill_size=True)  # type: ignore[arg-type]
    cfg = SchedulerConfig()
    assert cfg.chunked_prefill_size == 2048 and cfg.token_budget(LARGE) == 2048  # on by default
    assert SchedulerConfig(large_chunked_prefill_size=0).token_budget(LARGE) == 0


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("dispatch,mode", MODES)
@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("budget", [1, 2, 3, 7])
def test_chunked_exact(pair: Any, dispatch: str, mode: str, page_size: int, budget: int) -> None:
    """Prompts of 1-20 own tokens after a 13-token shared prefix (not page aligned), split into
    chunks that cut pages and the shared prefix anywhere; escalations make catch-ups that
    split too."""
    router = BernoulliRouter(0.3, seed=budget)
    prompts = make_prompts(5, seed=20 + budget, shared=13, lo=1, hi=20)
    _, res, rec = run_checked(
        pair, router, bernoulli_decide(router), prompts, 8, budget,
        num_slots=512, dispatch=dispatch, mode=mode, page_size=page_size,
    )  # fmt: skip
    assert res.stats.prefill_chunks > 0
    assert any(short for k, _, _, short in rec.forwards if k == SMALL)
    assert any(short for k, _, _, short in rec.forwards if k == LARGE)


@pytest.mark.parametrize("topology", ["one-device", "two-devices"])
@pytest.mark.parametrize("large_budget", [1, 4])
def test_long_catchups_split_small_unchunked(pair: Any, topology: str, large_budget: int) -> None:
    """Only catch-ups have a budget: every first catch-up (a whole prompt) is split, its
    request stays parked until the last chunk ran, and the other requests keep decoding on
    the small model between the chunks."""
    router = ScriptedRouter({0: [2], 1: [0, 5], 2: [3], 3: [1, 2, 7]})
    prompts = make_prompts(4, seed=31, shared=9, lo=10, hi=30)
    sched = SchedulerConfig(max_running=4, min_large_batch=1)
    _, res, rec = run_checked(
        pair, router, router.decide, prompts, 10, 0, large_budget,
        num_slots=1024, scheduler=sched, topology=topology, large_step_cost=2.0,
    )  # fmt: skip
    assert not any(short for k, _, _, short in rec.forwards if k == SMALL)
    large_short = [len(short) for k, _, _, short in rec.forwards if k == LARGE]
    st = res.stats
    assert st.catchup_partial_rows == sum(large_short) == st.prefill_chunks > 0
    # Without the partial rows: one row per catch-up of a request (its escalations).
    assert sum(st.catchup_batch_sizes) - st.catchup_partial_rows == st.escalations
    assert 0 < st.catchup_partial_kv_tokens < sum(st.catchup_kv_tokens)
    # Between two chunks of one catch-up the small model stepped the other requests.
    kinds = [k for k, _, _, _ in rec.forwards]
    assert any(
        a == LARGE and b == SMALL and c == LARGE
        for a, b, c in zip(kinds, kinds[1:], kinds[2:], strict=False)
    )


@settings(max_examples=25, deadline=None)
@given(
    budget=st.integers(1, 9),
    large_budget=st.one_of(st.none(), st.integers(1, 9)),
    page_size=st.sampled_from([1, 2, 4]),
    shared=st.integers(0, 12),
    lens=st.lists(st.integers(1, 14), min_size=1, max_size=5),
    p=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 1000),
)
def test_chunked_exact_property(
    pair: Any,
    budget: int,
    large_budget: int | None,
    page_size: int,
    shared: int,
    lens: list[int],
    p: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(shared)]
    prompts = [base + [rng.randrange(VOCAB) for _ in range(k)] for k in lens]
    router = BernoulliRouter(p, seed=seed)
    run_checked(
        pair, router, bernoulli_decide(router), prompts, 6, budget, large_budget,
        num_slots=256, page_size=page_size,
        scheduler=SchedulerConfig(max_running=rng.choice([1, 2, 4]), min_large_batch=2),
    )  # fmt: skip


def test_shared_prefix_held_back_while_it_is_chunked(pair: Any) -> None:
    """A request sharing an uncached prompt prefix with one whose chunked prefill has not
    reached the end of that prefix waits for it, then matches it in the tree: the shared
    prompt is computed once however many steps its prefill takes."""
    shared, n = 40, 3
    base = make_prompts(1, seed=41, shared=shared, lo=0, hi=0)[0]
    prompts = [[*base, 5 + i, 7 * i % VOCAB] for i in range(n)]
    router = ScriptedRouter()
    _, res, _ = run_checked(
        pair, router, router.decide, prompts, 4, 8, num_slots=1024,
        scheduler=SchedulerConfig(max_running=4),
    )  # fmt: skip
    assert res.stats.held_back > 0
    # The small model computed the shared prompt once, then each request's own tokens and
    # its decode tokens (max_new - 1 of them: the last token is never fed).
    assert res.stats.small_tokens == shared + sum(len(q) - shared for q in prompts) + n * 3


# ---------------------------------------------------------------- decode rows never stall


@pytest.mark.parametrize("long_first", [False, True])
@pytest.mark.parametrize("budget", [8, 16])
def test_decode_rows_never_stalled_by_a_long_prompt(
    pair: Any, budget: int, long_first: bool
) -> None:
    """A long prompt arrives while two requests decode (or first, the two then ahead of it
    in no order): every small step computes at most `budget` tokens, and once the two
    decode, every step of the long prefill holds both."""
    small, large = pair
    sched = SchedulerConfig(max_running=4, chunked_prefill_size=budget)
    eng = RoutedEngine(
        small, large, ScriptedRouter(), config=EngineConfig(num_slots=1024, scheduler=sched)
    )
    rec = Recorder(eng)
    short = make_prompts(2, seed=50, lo=3, hi=5)
    long = make_prompts(1, seed=51, lo=150, hi=150)[0]
    if long_first:
        hl = eng.submit(long, 4, route_key=2)
    hs = [eng.submit(q, 60, route_key=i) for i, q in enumerate(short)]
    if not long_first:
        for _ in range(3):
            eng.iterate()
        hl = eng.submit(long, 4, route_key=2)
    while eng.iterate():
        pass
    assert all(h.finished_reason == "length" for h in [*hs, hl])
    small_fw = [(rids, q, sh) for k, rids, q, sh in rec.forwards if k == SMALL]
    for _, q, _ in small_fw:
        assert sum(q) <= budget
    # The first step after which both short requests decode (their prefills done).
    decoding = max(
        next(i for i, (rids, _, sh) in enumerate(small_fw) if h.rid in rids and h.rid not in sh)
        for h in hs
    )
    prefill = [rids for rids, _, sh in small_fw[decoding + 1 :] if hl.rid in sh]
    assert len(prefill) >= 150 // budget - 2
    for rids in prefill:
        assert hs[0].rid in rids and hs[1].rid in rids
    ref, _ = reference_generate(small, large, [*short, long], 60, lambda r, p: False)
    assert [h.tokens for h in hs] == ref[:2] and hl.tokens == ref[2][:4]
    check_idle(eng)


# ---------------------------------------------------------------- failures mid-chunk


@pytest.mark.parametrize("dispatch,mode", MODES)
@pytest.mark.parametrize("which", ["small", "large"])
def test_forward_error_mid_chunk_releases_everything(
    pair: Any, dispatch: str, mode: str, which: str
) -> None:
    small, large = pair
    router = BernoulliRouter(0.4, seed=6)
    boom = RuntimeError("forward failed")
    if which == "small":
        small = FlakyModel(small, lambda i: i == 3, boom)
    else:
        large = FlakyModel(large, lambda i: i == 2, boom)
    sched = SchedulerConfig(chunked_prefill_size=5)
    eng = RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode, scheduler=sched),
    )
    rec = Recorder(eng)
    with pytest.raises(RuntimeError, match="forward failed"):
        eng.generate(make_prompts(4, seed=65, shared=11, lo=8, hi=16), 10)
    assert eng.stats.failed >= 1 and eng.stats.prefill_chunks > 0
    assert any(short for _, _, _, short in rec.forwards)
    check_idle(eng)
    check_exact(eng, pair, router)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_abort_mid_prefill_releases_everything(pair: Any, dispatch: str, mode: str) -> None:
    small, large = pair
    router = ScriptedRouter({0: [0], 1: [1]})
    sched = SchedulerConfig(chunked_prefill_size=4)
    eng = RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(num_slots=256, dispatch=dispatch, mode=mode, scheduler=sched),
    )
    prompts = make_prompts(3, seed=70, shared=6, lo=20, hi=30)
    handles = [eng.submit(q, 8, route_key=i) for i, q in enumerate(prompts)]
    if mode == "events":
        r = handles[2]._req
        for _ in range(40):
            eng.iterate()
            if r.partial_prefill:
                break
        assert r.partial_prefill and not r.tokens  # mid-prefill
    handles[2].abort()
    assert all(h.wait(60) for h in handles)
    assert handles[2].finished_reason == "abort" and handles[2].tokens == []
    ref, _ = reference_generate(small, large, prompts[:2], 8, router.decide)
    assert [h.tokens for h in handles[:2]] == ref
    check_idle(eng)


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_tiny_pool_preempts_mid_chunk(pair: Any, dispatch: str, mode: str) -> None:
    router = BernoulliRouter(0.25, seed=8)
    prompts = make_prompts(6, seed=8, shared=6, lo=10, hi=18)
    _, res, _ = run_checked(
        pair, router, bernoulli_decide(router), prompts, 12, 5,
        num_slots=64, dispatch=dispatch, mode=mode, page_size=2,
    )  # fmt: skip
    if mode == "events":
        assert res.stats.preemptions > 0
    assert res.stats.prefill_chunks > 0


@pytest.mark.parametrize("dispatch,mode", MODES)
def test_fault_injection_soak_chunked(pair: Any, dispatch: str, mode: str) -> None:
    """Forwards and the allocator failing at random steps, with budgets that split prompts
    and catch-ups: nothing leaks, the next run is exact."""
    small, large = pair
    inner = BernoulliRouter(0.3, seed=11)
    for seed in range(4):
        rng = random.Random(seed)
        rates = [rng.choice([0.0, 0.15, 0.3]) for _ in range(3)]
        flaky_small = FlakyModel(small, lambda i, r=rates[0], g=rng: g.random() < r, OSError("s"))
        flaky_large = FlakyModel(large, lambda i, r=rates[1], g=rng: g.random() < r, OSError("l"))
        sched = SchedulerConfig(
            max_running=rng.choice([2, 4]), min_large_batch=2, max_wait_steps=1,
            chunked_prefill_size=rng.choice([1, 3, 6]),
            large_chunked_prefill_size=rng.choice([None, 2, 5]),
        )  # fmt: skip
        eng = RoutedEngine(
            flaky_small,
            flaky_large,
            inner,
            config=EngineConfig(
                num_slots=96,
                dispatch=dispatch,
                mode=mode,
                page_size=rng.choice([1, 2, 4]),
                scheduler=sched,
            ),
        )
        pool = eng.large.pool
        real = pool.alloc_array
        flaky = Flaky(real, lambda i, r=rates[2], g=rng: g.random() < r, MemoryError("a"))
        pool.alloc_array = flaky  # type: ignore[method-assign]
        prompts = make_prompts(5, seed=200 + seed, shared=7, lo=6, hi=14)
        with contextlib.suppress(OSError, MemoryError):
            eng.generate(prompts, 8)
        check_idle(eng)
        pool.alloc_array = real  # type: ignore[method-assign]
        flaky_small._call.when = flaky_large._call.when = lambda i: False
        check_exact(eng, pair, inner)


@pytest.mark.parametrize("budget", [1, 3, 7])
@pytest.mark.parametrize("num_slots", [512, 64])
def test_naive_sglang_chunked_exact(pair: Any, budget: int, num_slots: int) -> None:
    """The naive protocol through SGLang's own RadixCache with the same budget: exact, and
    nothing left in its cache pinned (a split catch-up keeps its lock until its last chunk)."""
    from tokencache_routing.baselines.naive_sglang import sglang_api

    sglang_api()  # sglang missing fails this test (as test_naive_sglang.py), never skips it
    router = BernoulliRouter(0.3, seed=budget)
    prompts = make_prompts(5, seed=60 + budget, shared=11, lo=4, hi=18)
    eng, _, rec = run_checked(
        pair, router, bernoulli_decide(router), prompts, 10, budget,
        num_slots=num_slots, dispatch="naive-sglang",
    )  # fmt: skip
    assert any(short for k, _, _, short in rec.forwards if k == LARGE)
    for side in eng.sides:
        assert side.cache.protected_size() == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize("large_budget", [5, 16])
def test_shared_prompt_caught_up_once_in_chunks(pair: Any, mode: str, large_budget: int) -> None:
    """First catch-ups sharing a prompt prefix meet in one batch: the first one's catch-up is
    split in chunks, the others wait until it has passed the shared prefix, then match it in
    the large tree: the large model computes the shared prompt once."""
    n, shared, at = 5, 24, 3
    base = make_prompts(1, seed=40, shared=shared, lo=0, hi=0)[0]
    prompts = [[*base, (7 * i + 1) % VOCAB, (3 * i + 5) % VOCAB, i % VOCAB] for i in range(n)]
    router = ScriptedRouter({i: [at] for i in range(n)})
    sched = SchedulerConfig(
        max_running=8, min_large_batch=n, max_wait_steps=100, max_wait_s=30.0, min_occupancy=0
    )
    _, res, _ = run_checked(
        pair, router, router.decide, prompts, 8, 0, large_budget,
        num_slots=1024, scheduler=sched, mode=mode,
    )  # fmt: skip
    st = res.stats
    assert st.escalations == n and st.preemptions == 0
    written = sum(len(p) + at for p in prompts)
    assert sum(st.catchup_tokens) == written - (n - 1) * shared


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_overlap_runs_a_chunked_prompt_one_chunk_per_step(pair: Any, mode: str) -> None:
    """With overlap a prompt split in chunks goes on with its next chunk in the step launched
    while the one running its chunk is in flight (the chunk's tokens are known on the host):
    no step of the small model passes without one of its chunks, so its prompt takes as many
    small forwards as it has chunks and each forward after the first continues the previous
    one. (Joining only the step after, as before, leaves every other forward without it.)"""
    small, large = pair
    sched = SchedulerConfig(chunked_prefill_size=8)
    eng = RoutedEngine(
        small,
        large,
        EntropyRouter(math.inf),
        config=EngineConfig(num_slots=512, mode=mode, scheduler=sched),
    )
    assert eng.overlap
    prompt = make_prompts(1, seed=81, lo=41, hi=41)[0]  # 41 pending tokens: 6 chunks
    forwards: list[tuple[int, bool]] = []  # (tokens, continues the forward in flight)
    inner = eng.sched.schedule_small

    def schedule_small(after: Any = None) -> Any:
        prep = inner(after)
        if prep is not None:
            forwards.append((prep.num_tokens, prep.ahead is not None and bool(prep.ahead.any())))
        return prep

    eng.sched.schedule_small = schedule_small  # type: ignore[method-assign]
    res = eng.generate([prompt], 4)
    ref, _ = reference_generate(small, large, [prompt], 4, lambda rid, pos: False)
    assert res.tokens == ref
    assert [n for n, _ in forwards[:6]] == [8, 8, 8, 8, 8, 1]
    assert len(forwards) == 6 + 3  # the chunks, then a decode step per token after the first
    assert [cont for _, cont in forwards] == [False] + [True] * 8
    check_idle(eng)


@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_abort_between_chunks_in_flight_lists_the_request_once(pair: Any, mode: str) -> None:
    """A prompt chunked across steps in flight (overlap), aborted while one chunk's step is
    being finished and the next chunk's is already launched: its row there is dropped, and
    when that step (all of its rows dropped) is finished at once, the request, already back in
    the running list, is not listed there a second time (which scheduled it again after its
    abort: its KV re-attached and never released)."""
    small, large = pair
    sched = SchedulerConfig(chunked_prefill_size=5)
    eng = RoutedEngine(
        small,
        large,
        EntropyRouter(math.inf),
        config=EngineConfig(num_slots=512, mode=mode, scheduler=sched),
    )
    inner = eng.sched.finish_small
    aborted: list[bool] = []

    def finish_small(prep: Any, out: Any, now: float) -> Any:
        nxt = prep.successor
        if not aborted and nxt is not None and prep.incomplete[0] and nxt.ahead is not None:
            # The request's own handle: a threaded worker may get here before submit() has
            # returned it to this thread.
            aborted.append(prep.batch[0].handle.abort())  # between the two chunks' steps
        return inner(prep, out, now)

    # Hooked before the submit: a threaded worker may run every chunk before this thread
    # gets back from submit() (under load it did, and the abort never happened).
    eng.sched.finish_small = finish_small  # type: ignore[method-assign]
    handle = eng.submit(make_prompts(1, seed=83, lo=40, hi=40)[0], 6)
    assert handle.wait(60)
    eng.shutdown()
    assert aborted == [True] and handle.finished_reason == "abort" and handle.tokens == []
    check_idle(eng)
