"""RoutedEngine: two models, one scheduler, and an online API (submit -> handle).

Each model has its own RadixTree over its own KVPool; a request keeps a handle in each (a
tokencache Cursor, or the naive SGLang-style protocol). Requests are submitted at any time from
any thread; a driver runs the scheduler: the deterministic event loop (drivers/events.py: inline
in the caller's thread, or in a background thread after start()), or mode="threaded"
(drivers/threaded.py: one thread per model). generate() and stream() are built on submit().

The event loop keeps an engine clock: clock="steps" (a small step costs 1, a catch-up
large_step_cost: reproducible schedules), "measured" (forward wall times) or "gpu" (a GpuClock:
forwards priced at real model shapes on a GPU cost profile, so a CPU run judges a schedule by
GPU-shaped costs). topology="one-device" runs each catch-up between two small steps (its
requests rejoin the very next step); "two-devices" overlaps the models (a catch-up's requests
rejoin once the large model's clock says it finished). The naive dispatchers add a synchronous
barrier: every step waits for every parked request's catch-up.

overlap=True (the default for the tokencache dispatch): the next small step is prepared and
launched before the previous one is finished on the host, its continuing requests fed with
their drawn token on the device; the event loop's clock then keeps a host clock and a device
queue, charging only what the device waits for (README: "Overlapped scheduling").
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tokencache_models import CausalLM, KVPool
from tokencache_models.parallel.runtime import ShardFactory

from .baselines.naive import NaiveKV
from .config import EngineConfig, Topology
from .core.batch import PreparedForward
from .core.driver_api import Driver
from .core.kv import CursorKV, ModelSide
from .core.launch_policy import Price
from .core.routers import Router
from .core.scheduler import Scheduler
from .core.scheduler_config import SchedulerConfig
from .core.state import (
    GREEDY,
    LARGE,
    SMALL,
    GenerateResult,
    Request,
    RequestHandle,
    SamplingParams,
    Stats,
    as_token_array,
)
from .drivers.events import EventLoop, EventLoopThread
from .sim.clock import GpuClock
from .sim.pricing import forward_cost, launch_prices
from .tp_launch import engine_large
from .warm_up import WarmUp, cold_runs, warm_up_sides

_POLL_S = 0.02
_log = logging.getLogger("tokencache_routing")


class RoutedEngine:
    def __init__(
        self,
        small: CausalLM,
        large: CausalLM | ShardFactory,
        router: Router,
        config: EngineConfig | None = None,
    ) -> None:
        """config: everything else (config.py), validated on its construction; None: the
        defaults. With config.large_tp=N, `large` (a CausalLM, or a picklable shard factory
        such as tokencache_models.parallel.runtime.CheckpointShard(path)) runs tensor-parallel over
        N ranks the engine starts itself (tp_launch.py); shutdown() stops them. A lost rank
        ends every request with TPWorkerLost."""
        if config is None:
            config = EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {config!r}")
        self.config = config
        # large_tp: the large model's tensor-parallel group, started here (tp_launch.py).
        large, self._large_tp = engine_large(self, large, config)
        # Vocabularies may differ in size, not in meaning: checkpoints of one family pad their
        # embedding tables differently (R1-Distill-Qwen-1.5B 151,936 rows, -32B 152,064). The
        # engine routes over the ids both have; the rest of the logits are dropped.
        vocab = min(small.config.vocab_size, large.config.vocab_size)
        # Two GPUs: each model (and so its KV pool) on its own device; the threaded driver then
        # overlaps them for real, and the event loop's clock models the overlap.
        if config.small_device is not None:
            small = small.to(config.small_device)
        if config.large_device is not None:
            large = large.to(config.large_device)
        clock = config.clock
        dispatch = config.dispatch
        if config.topology is None:
            self.topology: Topology = (
                "one-device" if small.device == large.device else "two-devices"
            )
        else:
            self.topology = config.topology
        n_small, n_large, page_size = config.num_slots, config.large_slots, config.page_size
        self.mode = config.mode
        self.dispatch = dispatch
        self.tokenizer = config.tokenizer
        self.eos_token_id = config.eos_token_id
        self.large_step_cost = config.large_step_cost
        self.host_charge = config.host_charge
        # Overlapped scheduling: the next small step is prepared and launched before the one
        # the device runs now is finished on the host (its tokens drawn on the device).
        self.overlap = bool(config.overlap)  # resolved by EngineConfig
        self.gpu_clock = (
            GpuClock() if clock == "gpu" else clock if isinstance(clock, GpuClock) else None
        )
        self.clock = "gpu" if self.gpu_clock is not None else str(clock)
        self.vocab_size = int(vocab)

        side_cls: type[ModelSide] = ModelSide
        handle_cls: Any = CursorKV if dispatch == "tokencache" else NaiveKV
        if dispatch == "naive-sglang":
            from .baselines.naive_sglang import NaiveSGLangKV, SGLangSide  # imports sglang

            side_cls, handle_cls = SGLangSide, NaiveSGLangKV
        # kv_events: both trees record the pages they store and remove (RadixTree.take_events),
        # what a KV-event publisher (tokencache serve --kv-events-config) drains.
        kv_events = self.kv_events = config.kv_events
        self.sides = (
            side_cls("small", small, small.make_kv_pool(n_small), page_size, kv_events),
            side_cls("large", large, large.make_kv_pool(n_large), page_size, kv_events),
        )
        for s in self.sides:
            s.vocab_size = self.vocab_size
            s.sync_cuda = self.clock == "measured" and s.model.device.type == "cuda"
            if self.clock == "gpu":
                s.timer = time.thread_time
            if isinstance(s.model, CausalLM):  # its decode runner now, not in a first step
                s.model.executor.prepare_runner(s.pool)
        self.sched = Scheduler(
            self.sides,
            config.scheduler or SchedulerConfig(),
            router,
            handle_cls,
            barrier=dispatch != "tokencache",
            holdback=dispatch == "tokencache",
        )
        self.sched.prices = self.launch_prices()
        # A request needs at most prompt + max_new_tokens - 1 slots in each model, and positions
        # within both models' context windows.
        positions = min(small.config.max_position_embeddings, large.config.max_position_embeddings)
        self.max_context = min(n_small + 1, n_large + 1, positions)

        self._inbox: list[Request] = []  # submitted, not yet seen by the scheduler
        self._inbox_lock = threading.Lock()
        self._next_rid = 0
        self._drive_lock = threading.Lock()  # one inline driver at a time
        self._driver_lock = threading.Lock()  # starting / stopping driver threads
        self._driver: Driver | None = None  # EventLoopThread (events) or ThreadedDriver
        self._retired: Driver | None = None  # the last one that decided to stop (may be exiting)
        self._persistent = False  # start() was called: the driver runs until shutdown()
        self._closed = False
        self._current: list[RequestHandle] = []  # the latest stream: abort(int) indexes it
        # The event loop (drivers/events.py): its clocks and the pending step (overlap).
        self._events = EventLoop(self)
        self._wall0 = time.perf_counter()

    # ---------------------------------------------------------------- properties

    @property
    def small(self) -> ModelSide:
        return self.sides[SMALL]

    @property
    def large(self) -> ModelSide:
        return self.sides[LARGE]

    @property
    def stats(self) -> Stats:
        """The engine's counters since construction."""
        return self.sched.stats

    @property
    def sched_config(self) -> SchedulerConfig:
        return self.sched.cfg

    @property
    def router(self) -> Router:
        """The router the scheduler asks after each small step; assigning one swaps it for
        the steps to come (the bench primes its trees with ScriptedRouter(every=True))."""
        return self.sched.router

    @router.setter
    def router(self, router: Router) -> None:
        with self.sched.lock:
            self.sched.router = router

    def pools(self) -> tuple[KVPool, KVPool]:
        return self.small.pool, self.large.pool

    def idle_invariant(self) -> bool:
        """Nothing runs and nothing leaked: every slot free or cached, nothing pinned."""
        with self.sched.lock:
            idle = not self.sched.has_work()
            return idle and all(s.idle_invariant() for s in self.sides)

    def warm_up(self, progress: bool = False) -> WarmUp:
        """Makes, before any request, every CUDA graph the engine's forwards can replay and
        runs each once, as a server does before it listens (warm_up.py says what that covers);
        after it cold_runs() stays 0. progress: a tqdm bar per side on stderr."""
        return warm_up_sides(self.sides, self.sched.cfg, self.router, self.max_context, progress)

    def cold_runs(self) -> int:
        """Forwards that came outside every warmed graph key since warm_up (0 before it)."""
        return cold_runs(self.sides)

    @property
    def closed(self) -> bool:
        """shutdown() was called: no submission is accepted, drivers stop."""
        return self._closed

    def has_submissions(self) -> bool:
        """Driver interface: requests submitted but not yet taken in by intake()."""
        with self._inbox_lock:
            return bool(self._inbox)

    def now(self) -> float:
        """The engine clock: modelled (event loop) or wall time since construction (threaded)."""
        if self.mode == "threaded":
            return time.perf_counter() - self._wall0
        return self._events.now()

    # ---------------------------------------------------------------- online API

    def submit(
        self,
        prompt: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        route_key: int | None = None,
        arrival_s: float | None = None,
    ) -> RequestHandle:
        """Queues a request and returns its handle; validated here, before any work.
        route_key: the id routers see (RouterFeatures.rids); defaults to the handle's rid.
        arrival_s: the engine-clock time the request arrives (event-loop driver only; None:
        now): the event loop admits it no sooner (the small model idles until then when it
        has nothing else to run) and its TTFT counts from then. Benchmarks submit a whole
        arrival schedule at once with it, in arrival order (admission is FCFS)."""
        req = self._make_request(prompt, max_new_tokens, sampling, stop_token_ids, route_key)
        if arrival_s is not None:
            a = arrival_s
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
                raise ValueError(f"arrival_s must be a finite number, got {a!r}")
            if self.mode != "events":
                raise ValueError("arrival_s needs the event-loop driver (mode='events')")
            req.submitted_at = float(a)
        self._enqueue([req])
        assert req.handle is not None
        return req.handle

    def start(self) -> None:
        """Runs the driver in background threads until shutdown() (for servers)."""
        with self._driver_lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._persistent = True
        self._ensure_driver()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts every unfinished request, releases its KV and stops the driver threads."""
        with self._driver_lock:
            self._closed = True
            self._persistent = False
            drivers = [d for d in (self._driver, self._retired) if d is not None]
        with self._inbox_lock:
            pending = list(self._inbox)
        for r in pending + self.sched.active() + list(self.sched.waiting):
            self.abort_request(r)
        for driver in drivers:
            driver.wake()
            driver.join(timeout)
        self._flush_aborts()
        if self._large_tp is not None:
            self._large_tp.stop()  # the large model's worker ranks

    def metrics(self) -> dict[str, float]:
        st, s = self.stats, self.sched
        with s.lock:
            out: dict[str, float] = {
                "requests_submitted": self._next_rid,
                "requests_running": len(s.active()),
                "requests_waiting": len(s.waiting) + len(self._inbox),
                "requests_finished": st.finished,
                "tokens_generated": st.tokens,
                "tokens_large": st.large_tokens,
                "escalations": st.escalations,
                "catchups": len(st.catchup_batch_sizes),
                "preemptions": st.preemptions,
                "requests_aborted": st.aborted,
                "requests_failed": st.failed,
                "small_steps": st.steps,
                "small_batch_occupancy": st.small_batch_occupancy,
                "bookkeeping_share": st.bookkeeping_share,
                "engine_clock_s": self.now(),
            }
            for side in self.sides:
                cached = side.cached_size()
                out[f"{side.name}_kv_slots_free"] = side.pool.available
                out[f"{side.name}_kv_slots_cached"] = cached
                out[f"{side.name}_kv_slots_used"] = side.pool.num_slots - side.pool.available
                out[f"{side.name}_kv_slots_pinned"] = side.pinned_size()
                out[f"{side.name}_kv_slots_total"] = side.pool.num_slots
        return out

    # ---------------------------------------------------------------- batch API

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> GenerateResult:
        start, t0 = self.stats.copy(), time.perf_counter()
        m0 = self.now()
        tokens: list[list[int]] = [[] for _ in prompts]
        models: list[list[int]] = [[] for _ in prompts]
        for rid, tok, model in self.stream(prompts, max_new_tokens):
            tokens[rid].append(tok)
            models[rid].append(model)
        handles = self._current
        stats = self.stats.since(start)
        stats.wall_s = time.perf_counter() - t0
        stats.modeled_s = self.now() - m0 if self.mode == "events" else stats.wall_s
        texts = [self.tokenizer.decode(t) for t in tokens] if self.tokenizer is not None else None
        reasons = [h.finished_reason or "abort" for h in handles]
        return GenerateResult(tokens, models, texts, stats, reasons)

    def stream(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> Iterator[tuple[int, int, int]]:
        """Yields (prompt index, token, model) as tokens are committed. abort(i) stops the
        i-th request: no event for it is yielded after the call. A request that failed raises
        its error here (the others are aborted)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a sequence of token-id sequences")
        reqs = [self._make_request(p, max_new_tokens, None, (), i) for i, p in enumerate(prompts)]
        handles = [r.handle for r in reqs]
        assert all(h is not None for h in handles)
        return self._stream(reqs, handles)  # type: ignore[arg-type]

    def _stream(
        self, reqs: list[Request], handles: list[RequestHandle]
    ) -> Iterator[tuple[int, int, int]]:
        self._current = handles
        news: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i, h in enumerate(handles):
            h.add_listener(functools.partial(_put_index, news, i))
        # Before enqueueing: a driver thread may finish (or fail) a request at once.
        left = {i for i, r in enumerate(reqs) if r.finished_reason is None}
        self._enqueue(reqs)
        seen = [0] * len(reqs)
        try:
            while left:
                try:
                    i = news.get_nowait()
                except queue.Empty:
                    self._progress(lambda: not news.empty())
                    continue
                r = reqs[i]
                with r.lock:
                    new = list(zip(r.tokens[seen[i] :], r.token_models[seen[i] :], strict=True))
                    done = r.finished_reason is not None
                seen[i] += len(new)
                for tok, model in new:
                    if r.abort_requested:
                        break
                    yield i, tok, model
                if done and seen[i] >= len(r.tokens):
                    left.discard(i)
                    if r.finished_reason == "error" and r.error is not None:
                        raise r.error
        finally:
            for r in reqs:
                if r.finished_reason is None:
                    self.abort_request(r)
            self._flush_aborts()
            self._join_idle_driver()

    def _join_idle_driver(self, timeout: float = 30.0) -> None:
        """Threaded mode without start(): the workers stop once idle; wait for them, so a
        generate() leaves no thread behind."""
        if self._persistent:
            return
        for d in (self._driver, self._retired):
            if d is not None:
                d.wake()
                d.join(timeout)

    def abort(self, rid: int | RequestHandle) -> bool:
        """Stops a request: a RequestHandle, or an index into the latest stream()/generate()'s
        prompts. Returns False (a no-op) when it already finished or was aborted."""
        if isinstance(rid, RequestHandle):
            return rid.abort()
        if isinstance(rid, bool) or not isinstance(rid, (int, np.integer)):
            raise TypeError(f"abort: a request index (int) or RequestHandle, got {rid!r}")
        if not self._current:
            raise RuntimeError("abort: no stream has started on this engine")
        if not 0 <= rid < len(self._current):
            raise ValueError(
                f"abort: unknown request {rid!r} (the stream has {len(self._current)})"
            )
        return self._current[int(rid)].abort()

    # ---------------------------------------------------------------- requests

    def _make_request(
        self,
        prompt: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        sampling: SamplingParams | None,
        stop_token_ids: Sequence[int],
        route_key: int | None,
    ) -> Request:
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._large_tp is not None:
            self._large_tp.check()  # a lost tensor-parallel group: no request can finish
        m = max_new_tokens
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
            raise TypeError(f"max_new_tokens must be an int, got {m!r}")
        if m < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {m}")
        arr = as_token_array(prompt, self.vocab_size)
        if len(arr) + m > self.max_context:
            raise ValueError(
                f"prompt ({len(arr)} tokens) + max_new_tokens ({m}) can never fit: at most "
                f"{self.max_context} (KV pools: small {self.small.pool.num_slots}, large "
                f"{self.large.pool.num_slots} slots; context windows)"
            )
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be a SamplingParams")
        stops = (
            set(as_token_array(list(stop_token_ids), self.vocab_size)) if stop_token_ids else set()
        )
        if self.eos_token_id is not None:
            stops.add(int(self.eos_token_id))
        with self._inbox_lock:
            rid = self._next_rid
            self._next_rid += 1
        key = rid if route_key is None else int(route_key)
        stop_set = frozenset(int(s) for s in stops)
        req = Request(
            rid, key, arr, int(m), sampling or GREEDY, stop_set, lock=self.sched.delivery_lock
        )
        req.submitted_at = self.now()
        RequestHandle(req, self)
        if m == 0:
            req.finished_reason = "length"
        return req

    def _enqueue(self, reqs: list[Request]) -> None:
        live = [r for r in reqs if r.finished_reason is None]
        with self._inbox_lock:
            self._inbox += live
        for r in reqs:
            if r.finished_reason is not None:
                self.notify([r])
        if live:
            self._ensure_driver()

    def abort_request(self, r: Request) -> bool:
        """RequestDriver interface (RequestHandle.abort): r is aborted at the driver's next
        iteration; False when it already finished, is ending or was aborted."""
        with r.lock:
            if r.finished_reason is not None or r.ending is not None or r.abort_requested:
                return False
            r.abort_requested = True
        driver = self._driver
        if driver is not None:
            driver.wake()
        return True

    def _flush_aborts(self, force: bool = False) -> None:
        """Applies pending aborts now when no driver thread will (inline use)."""
        if self._driver_alive() and not force:
            return
        with self.sched.lock:
            self.intake()
            self.sched.apply_aborts()
            if self._events.pending is not None:  # its requests end (aborted) or go on
                self._events.land_pending()
                self.sched.apply_aborts()
            touched = self.sched.take_touched()
        self.notify(touched)

    def notify(self, reqs: list[Request]) -> None:
        """Driver interface: runs the listeners of requests with news (never under the
        scheduler lock), each request's once; waiters poll (_progress)."""
        seen: set[int] = set()
        for r in reqs:
            if not r.listeners or r.rid in seen:
                continue
            seen.add(r.rid)
            with r.lock:
                listeners = list(r.listeners)
            for fn in listeners:
                assert r.handle is not None
                try:
                    fn(r.handle)
                except Exception as e:  # this request's problem: the others are still told
                    self._listener_failed(r, e)

    def fail_all(self, error: BaseException, lock_wait_s: float | None = None) -> None:
        """Every unfinished request ends with `error` at its driver's next iteration (one
        inside a forward when that forward ends): its KV released, its caller told (a lost
        tensor-parallel worker, tp_launch). lock_wait_s: how long to wait for the scheduler's
        lock (None: as long as it takes); past it, requests listed without the lock (those
        that changed meanwhile end at their forward)."""
        with self._inbox_lock:
            reqs = list(self._inbox)
        lock = self.sched.lock
        got = lock.acquire(timeout=-1 if lock_wait_s is None else lock_wait_s)
        try:
            reqs += self.sched.active() + list(self.sched.waiting)
        except RuntimeError:  # changed while read without the lock: those end at their forward
            pass
        finally:
            if got:
                lock.release()
        for r in reqs:  # as a failed listener ends its request (_listener_failed)
            with r.lock:
                if r.finished_reason is None and r.ending is None and r.failure is None:
                    r.failure = error
                    r.abort_requested = True
        driver = self._driver  # inline use (no driver thread): the caller's next iteration
        if driver is not None:
            driver.wake()

    def _listener_failed(self, r: Request, error: Exception) -> None:
        """A listener raised: its request ends with that error at the driver's next iteration
        (as an abort would, nothing more delivered). Already ending, it keeps its own end."""
        with r.lock:
            late = r.finished_reason is not None or r.ending is not None
            if not late and r.failure is None:
                r.failure = error
                r.abort_requested = True
        if late:
            _log.warning("listener of finished request %d raised %r", r.rid, error)
            return
        driver = self._driver
        if driver is not None:
            driver.wake()

    # ---------------------------------------------------------------- driving

    def _driver_alive(self) -> bool:
        d = self._driver
        return d is not None and d.alive()

    def _ensure_driver(self) -> None:
        """Threaded mode and start(): make sure the driver threads run."""
        if self.mode == "events" and not self._persistent:
            return
        with self._driver_lock:
            if self._driver is not None and self._driver.alive():
                self._driver.wake()
                return
            if self.mode == "threaded":
                from .drivers.threaded import ThreadedDriver

                self._driver = ThreadedDriver(self)
            else:
                self._driver = EventLoopThread(self)
            self._driver.start()

    def driver_should_exit(self) -> bool:
        """Called by an idle driver thread: exit unless start() keeps it (under _driver_lock
        so a racing submit either sees it alive or starts a new one)."""
        with self._driver_lock, self._inbox_lock:
            if self._persistent or self._inbox:
                return False
            with self.sched.lock:
                if self.sched.has_work():
                    return False
            self._retired, self._driver = self._driver, None
            return True

    # ---------------------------------------------------------------- RequestDriver

    def wait_request(self, r: Request, timeout: float | None) -> bool:
        """RequestDriver interface (RequestHandle.wait): True once r finished, False after
        `timeout` seconds; drives the engine inline when no driver thread does."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while r.finished_reason is None:
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                return False
            self._progress(lambda: r.finished_reason is not None, left)
        return True

    def wait_for_progress(self, r: Request, seen: int) -> None:
        """RequestDriver interface (iterating a RequestHandle): more tokens than `seen`, the
        end, or a short wait."""
        self._progress(lambda: len(r.tokens) > seen or r.finished_reason is not None)

    def _progress(self, ready: Any, timeout: float | None = None) -> None:
        """Drives one iteration inline, or waits a little for a driver thread."""
        if ready():
            return
        step = _POLL_S if timeout is None else min(_POLL_S, timeout)
        if self._driver_alive() or self.mode == "threaded":
            self._ensure_driver()
            time.sleep(step / 4)
            return
        if self._drive_lock.acquire(blocking=False):
            try:
                worked = self.iterate()
            finally:
                self._drive_lock.release()
            if not worked and not ready():
                time.sleep(step / 4)  # another thread's requests, or nothing yet
        else:
            time.sleep(step / 4)

    def iterate_exclusive(self) -> bool:
        """Driver interface (the event-loop thread): iterate() under the drive lock, so no
        inline driver (_progress) runs beside it."""
        with self._drive_lock:
            return self.iterate()

    def drain_exclusive(self) -> None:
        """Driver interface (the event-loop thread, exiting): the aborts left applied and a
        pending step finished, under the drive lock."""
        with self._drive_lock:
            self._flush_aborts(force=True)

    def intake(self) -> None:
        """Driver interface: submitted requests enter the scheduler (under its lock)."""
        with self._inbox_lock:
            new, self._inbox = self._inbox, []
        for r in new:
            self.sched.add(r)

    def iterate(self) -> bool:
        """One event-loop iteration (admission, maybe a catch-up, a small step); False when
        there was nothing to do."""
        s = self.sched
        with s.lock:
            try:
                worked = self._events.iterate_locked()
            finally:
                touched = s.take_touched()
        self.notify(touched)  # outside the scheduler lock: listeners may abort
        return worked

    def runner_host_work(self, prep: PreparedForward) -> None:
        """The modelled runner's host work that this engine's runner may not have done: a GPU
        clock whose runner reads shared prefixes once needs the forward's candidate prefix
        groups (HostBatch.candidate_groups, kept on prep.host: free when the runner found
        them, as the GPU runner does; found here for the CPU runner). Timed with the step's
        host time; forward_cost, the clock's pricing, is not the engine's work and is not."""
        clock = self.gpu_clock
        if clock is not None and clock.shared_prefix:
            prep.host.candidate_groups()

    def launch_prices(self) -> Price:
        """What SchedulerConfig(launch="cost") prices holes and catch-ups with (both drivers;
        sim/pricing.py)."""
        overlapped = self.overlap or self.host_charge == "overlap"
        gpu, clock, charge = self.gpu_clock, self.clock, self.host_charge
        return launch_prices(gpu, clock, self.large_step_cost, charge, overlapped, self.stats)

    def forward_cost(self, kind: int, prep: PreparedForward, measured_s: float) -> float:
        """The forward's device cost on the engine clock (measured_s: its measured device
        time; sim/pricing.py), called once per launched forward; a tool may wrap it on an
        instance to see each price (bench_workloads.StepTrace)."""
        gpu, clock, step_cost = self.gpu_clock, self.clock, self.large_step_cost
        return forward_cost(gpu, clock, step_cost, kind, prep, measured_s)


def _put_index(q: queue.SimpleQueue[int], i: int, _handle: RequestHandle) -> None:
    q.put(i)
