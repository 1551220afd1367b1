"""The one scheduler both drivers run: admission, make-room (evict, then preempt), catch-up
batching, and the commit of each forward's tokens (schedule -> run -> postprocess).

Drivers (drivers/events.py's event loop, drivers/threaded.py's two threads) call it while
holding its lock and run the forwards themselves; a request inside a running forward is `busy`
and nobody else touches it. Every way out (finish, abort, preemption, an error in a forward, the
router or the allocator) releases the request's KV in both models: nothing stays pinned or
allocated.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import Literal, get_args

import numpy as np
import torch

from tokencache_models import ForwardOutput

from .batch import (
    PreparedForward,
    RowPlan,
    attach_all,
    chunk_ends,
    prepare_forward,
)
from .holdback import PrefillIndex, take_catchup_batch
from .kv import KVHandle, ModelSide
from .routers import Router
from .sampling import draw, route
from .state import LARGE, SMALL, Request, Stats

LaunchPolicy = Literal["threshold", "cost"]
LAUNCH_POLICIES: tuple[str, ...] = get_args(LaunchPolicy)

# What a forward costs on the engine's clock: price(kind, batch, new_tokens, kv_tokens) in
# seconds (or the step clock's units). The engine builds it from its clock (RoutedEngine,
# launch_prices): the GPU clock's model, the step clock's constants, or MeasuredPrices.
Price = Callable[[int, int, int, int], float]

# Per-request reads of a step, mapped over its batch in C (a generator or a lambda would be a
# Python call per request per step).
_STEP_ORDER = attrgetter("last_small_step", "admit_order")  # who waited longest steps first
_LENGTH = attrgetter("length")  # a handle's committed tokens
_N = attrgetter("n")  # a request's tokens so far


def end_reasons(reqs: Sequence[Request], tokens: Sequence[int]) -> list[str | None]:
    """Why each request ends when its token is appended, or None when it goes on: "stop" for
    a stop or eos token, "length" once it has max_new_tokens. A stop token that is also the
    last token allowed ends it with "stop" (OpenAI's rule: a matched stop wins). The one
    place the rule lives: both models' tokens end through it (finish_small, commit_token), a
    step's rows in one call (no Python call per row: test_host_path counts them)."""
    return [
        "stop"
        if t in r.stop_token_ids
        else "length"
        if r.n + 1 - r.prompt_len >= r.max_new_tokens
        else None
        for r, t in zip(reqs, tokens, strict=True)
    ]


def fixed_part(price: Price, kind: int, rows: int, tokens: int, kv_tokens: int) -> float:
    """A forward's fixed cost: its price at these rows minus their per-row part, taken as the
    intercept of the price's linear extension, 2 * P(rows) - P(2 * rows) (tokens and KV
    doubled too), never below 0. On a linear clock that is its constant; on the roofline a
    memory-bound forward's weight read (Qwen3-8B: ~5 ms on h200-roofline, Qwen3-0.6B:
    ~0.4 ms) and 0 for a compute-bound one (a bigger batch saves nothing there)."""
    if rows <= 0:
        return 0.0
    one = price(kind, rows, tokens, kv_tokens)
    return max(0.0, 2 * one - price(kind, 2 * rows, 2 * tokens, 2 * kv_tokens))


def hole_loss_s(
    price: Price, batch: int, tokens: int, kv_tokens: int, holes: int, hole_kv: int
) -> float:
    """What one small step of `batch` rows (tokens new, kv_tokens KV slots read) loses by
    running with `holes` empty places whose parked requests hold hole_kv slots of context:
    the time their tokens would take at the full batch's rate, minus what the holes save the
    step. Their KV is not saved, only deferred (their tokens read it when they come back), so
    what is lost is the holes' share of the full step's fixed part (fixed_part):
    holes / (batch + holes) * fixed. Where the parked contexts are the batch's mean that is
    exactly holes * full / (batch + holes) - (full - now); where they are longer, that
    difference would count a deferred read as a saving (and could fall to 0: a catch-up
    that never launches). On a KV-bound step a hole costs little: its share of the weight
    read (and of the host time the clock charges a step)."""
    if holes <= 0:
        return 0.0
    full = batch + holes
    return holes / full * fixed_part(price, SMALL, full, tokens + holes, kv_tokens + hole_kv)


def catchup_fixed_s(price: Price, rows: int, tokens: int, kv_tokens: int) -> float:
    """A catch-up's fixed cost (fixed_part of the large model's forward): what launching it
    pays whatever its rows, the price a hole's accumulated loss is weighed against."""
    return fixed_part(price, LARGE, rows, tokens, kv_tokens)


class MeasuredPrices:
    """Prices from measured forward times, for clocks without a model of their own
    (clock="measured", the threaded driver's wall clock): a small step costs the moving
    average of the recent small steps (a GPU decode step costs about the same at any batch;
    what a hole saves is not modelled, so holes look dearer and catch-ups launch sooner) and a
    catch-up the least one measured so far (the smallest catch-ups are mostly the fixed cost),
    nothing before the first (the first parked request then launches at once)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.small_s: float | None = None
        self.large_s: float | None = None

    def observe(self, kind: int, seconds: float) -> None:
        if kind == SMALL:
            old = self.small_s
            self.small_s = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        else:
            self.large_s = seconds if self.large_s is None else min(self.large_s, seconds)

    def __call__(self, kind: int, batch: int, tokens: int, kv_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        seen = self.small_s if kind == SMALL else self.large_s
        return seen or 0.0


def _check_int(name: str, v: object, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"SchedulerConfig.{name} must be an int >= {lo}, got {v!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_running: requests decoding on the small model at once (its batch cap).
    max_parked: requests admitted beyond that (None: as many as max_running; 0: none), so the
    places of parked requests and of those inside a catch-up are filled instead of stepping a
    fragment. Admission is FCFS up to max_admitted = max_running + max_parked whatever the
    batch holds; when more are ready than max_running, the small batch takes the longest
    waiting first (Scheduler.admit, schedule_small).
    On one device (a catch-up stalls the small model), a catch-up launches once
    min_large_batch requests are parked, or the oldest has waited max_wait_steps small steps
    (max_wait_s seconds in the threaded driver), or the small model has nothing else to run,
    or parked requests nobody replaced leave the small batch below min_occupancy of what could
    run (min(max_running, admitted)): while the queue refills their places, waiting for a
    bigger catch-up costs the small model nothing; in a drained tail each parked request is a
    hole. With the large model on its own device, a catch-up launches whenever that device is
    idle and anything is parked (those three knobs do not apply). The naive dispatchers ignore
    the delay: a synchronous barrier sends every parked request each step. A first catch-up
    that shares a prompt page with another in the same batch is held for the next batch, never
    longer.
    Chunked prefill: a small step computes at most chunked_prefill_size tokens and a catch-up
    at most large_chunked_prefill_size (None: chunked_prefill_size; 0: no budget), as
    SGLang's chunked_prefill_size / vLLM's max_num_batched_tokens. Decode rows go first, the
    rest of the budget to prefills and catch-ups in the scheduler's order (batch.chunk_ends);
    a request whose chunk stops short of its last token commits the chunk's KV and keeps its
    place (running, or parked: a catch-up finishes before its request rejoins the small model)
    for the next step, where it goes on; only its last chunk samples. Default 2048 (vLLM's
    long-standing default; SGLang's for small GPUs): on the h200-roofline clock a step of
    Qwen3-0.6B costs the same with a 2048-token chunk beside 31 decode rows at 6.6k context as
    without it (8 ms, the KV read hides the chunk's FLOPs), and any chunk of 256 tokens or more
    is compute-bound already (a bigger one saves nothing); a 2048-token catch-up chunk of
    Qwen3-8B costs 51 ms, a one-device stall that a smaller large_chunked_prefill_size
    shortens (BENCHMARKS.md, "Chunked prefill").
    launch: "threshold" (default), the rules above; "cost", decided from the engine clock's
    prices instead of knobs (ski rental): at each small step the scheduler adds what the
    parked requests' unrefilled places cost that step (hole_loss_s: their share of the step's
    fixed part, the weight read and host time a hole wastes; their KV reads are deferred, not
    saved) and launches a catch-up once that sum reaches the catch-up's fixed cost
    (catchup_fixed_s: the large model's weight read on the roofline, plus the host time the
    clock charges a catch-up), then starts again from 0. Hard triggers as before: nothing
    else to run, a catch-up chunk not finished, the large model on its own device; also
    max_large_batch parked, and max_wait_steps / max_wait_s when > 0 (a latency cap; 0:
    none).
    min_large_batch and min_occupancy do not apply. While the queue refills parked places
    nothing is lost and the catch-up waits (until max_parked are parked, then places go
    empty). BENCHMARKS.md, "The cost launch policy"."""

    max_running: int = 32
    min_large_batch: int = 1
    max_wait_steps: int = 0
    max_large_batch: int | None = None
    max_wait_s: float = 0.0
    max_parked: int | None = None
    min_occupancy: float = 0.8
    chunked_prefill_size: int = 2048
    large_chunked_prefill_size: int | None = None
    launch: LaunchPolicy = "threshold"

    def __post_init__(self) -> None:
        if self.launch not in LAUNCH_POLICIES:
            raise ValueError(
                f"SchedulerConfig.launch must be one of {LAUNCH_POLICIES}, got {self.launch!r}"
            )
        _check_int("max_running", self.max_running, 1)
        _check_int("chunked_prefill_size", self.chunked_prefill_size, 0)
        if self.large_chunked_prefill_size is not None:
            _check_int("large_chunked_prefill_size", self.large_chunked_prefill_size, 0)
        _check_int("min_large_batch", self.min_large_batch, 1)
        _check_int("max_wait_steps", self.max_wait_steps, 0)
        if self.max_large_batch is not None:
            _check_int("max_large_batch", self.max_large_batch, 1)
        if self.max_parked is not None:
            _check_int("max_parked", self.max_parked, 0)
        w = self.max_wait_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"SchedulerConfig.max_wait_s must be a finite number >= 0, got {w!r}")
        o = self.min_occupancy
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not 0 <= o <= 1:
            raise ValueError(f"SchedulerConfig.min_occupancy must be in [0, 1], got {o!r}")

    def token_budget(self, kind: int) -> int:
        """The most tokens one forward of that model computes (0: no budget)."""
        large = self.large_chunked_prefill_size
        return self.chunked_prefill_size if kind == SMALL or large is None else large

    @property
    def max_admitted(self) -> int:
        parked = self.max_running if self.max_parked is None else self.max_parked
        return self.max_running + parked

    def waited_out(self, waited: float, cap: float) -> bool:
        """The oldest parked request has waited its maximum (`cap`: max_wait_steps, or
        max_wait_s in the threaded driver). Under launch="cost" a cap of 0 is none."""
        if self.launch == "cost" and cap <= 0:
            return False
        return waited >= cap

    def launch_large(
        self,
        num_parked: int,
        waited_out: bool,
        num_on_small: int,
        num_admitted: int,
        own_device: bool = False,
        hole_loss_s: float = 0.0,
        fixed_s: float = 0.0,
    ) -> bool:
        """Launch a catch-up now (the large model is idle)? num_on_small: requests holding a
        place in the small batch (Scheduler.num_on_small); num_admitted: admitted unfinished
        requests, parked included; waited_out: the oldest parked request has waited its
        maximum; own_device: the large model runs on a device of its own, so a catch-up
        stalls nobody and waiting for a bigger one only delays it (an idle large device
        is free; while it is busy, parked requests gather into the next batch anyway).
        launch="cost": hole_loss_s, what the holes cost the small model since the last
        catch-up, against fixed_s, the next catch-up's fixed cost."""
        if num_parked == 0:
            return False
        if own_device or num_on_small == 0 or waited_out:
            return True
        if self.launch == "cost":
            if self.max_large_batch is not None and num_parked >= self.max_large_batch:
                return True
            return hole_loss_s >= fixed_s
        if num_parked >= self.min_large_batch:
            return True
        could_run = min(self.max_running, num_admitted)
        return num_on_small < self.min_occupancy * could_run


class WaitForMemory(Exception):
    """make_room: only requests inside the other model's running forward could free memory."""


# A driver's clock: seconds on the engine's clock now (stamped on delivered tokens).
Clock = Callable[[], float]


class Scheduler:
    def __init__(
        self,
        sides: tuple[ModelSide, ModelSide],
        config: SchedulerConfig,
        router: Router,
        handle_cls: Callable[[ModelSide], KVHandle],
        barrier: bool,
        holdback: bool,
    ) -> None:
        self.sides = sides
        self.cfg = config
        self.router = router
        self.handle_cls = handle_cls
        self.barrier = barrier  # naive dispatchers: every parked request each step
        self.holdback = holdback  # shared-prefix admission hold-back (cursors only)
        self.lock = threading.RLock()
        # Guards every request's delivery fields (Request.lock of an engine's requests): a
        # step hands out its tokens under one acquire.
        self.delivery_lock = threading.RLock()
        self.stats = Stats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # on the small side, ready for its next step
        self.parked: list[Request] = []  # waiting for a catch-up
        self.inflight: list[Request] = []  # catch-up done, back once the large clock says so
        self.busy: list[Request] = []  # inside a forward that runs now
        self.admit_blocked = False
        self.admitted = 0
        self.touched: list[Request] = []  # requests with news for their listeners
        # launch="cost": the engine's prices (RoutedEngine sets them; None: every parked
        # request launches at once) and what holes cost the small model since the last
        # catch-up (hole_loss_s, ski rental).
        self.prices: Price | None = None
        self.hole_loss_s = 0.0
        self._large_cached: dict[int, int] = {}  # id(parked request) -> large tree's prefix

    # ------------------------------------------------------------ state

    def active(self) -> list[Request]:
        return self.running + self.parked + self.inflight + self.busy

    def num_active(self) -> int:
        """len(active()), without building the list."""
        return len(self.running) + len(self.parked) + len(self.inflight) + len(self.busy)

    def num_on_small(self) -> int:
        """Requests holding a place in the small model's batch: ready to step or inside its
        forward. Parked ones and those in a catch-up (inflight, or busy in the large forward)
        hold none: admission refills their places up to max_admitted, and on their return the
        batch cap (schedule_small) keeps the batch at max_running."""
        return len(self.running) + sum(1 for r in self.busy if r.busy_model == SMALL)

    def launch_due(self, waited_out: bool, own_device: bool) -> bool:
        """SchedulerConfig.launch_large on this scheduler's state (both drivers ask it). A
        catch-up whose last chunk has not run yet goes on at once."""
        if not self.parked:  # nothing to catch up (launch_large's first answer, sooner)
            return False
        waited_out = waited_out or any(r.partial_prefill for r in self.parked)
        cost = self.cfg.launch == "cost"
        return self.cfg.launch_large(
            len(self.parked),
            waited_out,
            self.num_on_small(),
            self.num_active(),
            own_device,
            self.hole_loss_s,
            self.catchup_fixed_s() if cost and not waited_out and not own_device else 0.0,
        )

    def catchup_fixed_s(self) -> float:
        """The fixed cost of a catch-up of the parked requests now (catchup_fixed_s at their
        rows, tokens to compute and contexts; max_large_batch of them at most), on the
        engine's prices; 0 without prices."""
        price = self.prices
        if price is None:
            return 0.0
        batch = self.parked[: self.cfg.max_large_batch or len(self.parked)]
        ctx = [self._large_context(r) for r in batch]
        tokens = sum(r.n for r in batch) - sum(ctx)
        return catchup_fixed_s(price, len(batch), max(tokens, len(batch)), sum(ctx))

    def _large_context(self, r: Request) -> int:
        """The tokens of r the large model holds KV for: its handle's length, or before its
        first catch-up what the large tree has cached of its prompt (a shared system prompt:
        matched once per request, kept until the next launch)."""
        if len(r.kv) > LARGE and r.kv[LARGE].attached:
            return r.kv[LARGE].length
        known = self._large_cached.get(id(r))
        if known is None:
            known = self._large_cached[id(r)] = self._cached_len(LARGE)(r)
        return known

    def _charge_holes(self, prep: PreparedForward, could_run: int) -> None:
        """launch="cost": add what this small step loses to the places parked requests leave
        empty (nobody refilled them: up to could_run, the batch target), priced with the
        parked requests' mean context (hole_loss_s)."""
        holes = min(len(self.parked), could_run - len(prep.batch))
        price = self.prices
        if holes <= 0 or price is None:
            return
        mean_ctx = sum(r.n for r in self.parked) / len(self.parked)
        kv = int(prep.kv_lens.sum())
        self.hole_loss_s += hole_loss_s(
            price, len(prep.batch), prep.num_tokens, kv, holes, round(holes * mean_ctx)
        )

    def observe_forward(self, kind: int, seconds: float) -> None:
        """A forward's measured time, for prices that learn from them (MeasuredPrices)."""
        prices = self.prices
        if isinstance(prices, MeasuredPrices):
            prices.observe(kind, seconds)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked or self.inflight or self.busy)

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def _remove(self, r: Request) -> None:
        for lst in (self.running, self.parked, self.inflight, self.busy):
            if r in lst:
                lst.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)

    def _release(self, r: Request) -> None:
        """Both models' KV back (cached prefix stays in the trees); safe to call twice."""
        first: BaseException | None = None
        for h in r.kv:
            try:
                h.release(r.seq)
            except BaseException as e:  # release the other model's KV all the same
                first = first or e
        if first is not None:
            raise first

    def finish(self, r: Request, reason: str, error: BaseException | None = None) -> None:
        """r leaves for good: KV released, the caller told. A release that raises ends r with
        that error (its delivered tokens stay) instead of escaping into the batch being
        finished: the rest of the batch must still end. Only a BaseException (an interrupt)
        propagates, after r is marked finished."""
        self._remove(r)
        try:
            self._release(r)
        except Exception as e:
            reason, error = "error", error or e
        finally:
            with r.lock:
                if r.failure is not None and reason != "error":
                    reason, error = "error", r.failure
                elif r.abort_requested and reason != "error":
                    reason = "abort"
                r.finished_reason = reason
                r.error = error
            self.stats.finished += 1
            if reason == "abort":
                self.stats.aborted += 1
            elif reason == "error":
                self.stats.failed += 1
            self.admit_blocked = False  # memory came back
            self.touched.append(r)

    def fail(self, batch: Sequence[Request], error: BaseException) -> None:
        """Every unfinished request of the batch ends with `error`, even if ending one of them
        is interrupted (the interrupt is re-raised once all have ended)."""
        interrupt: BaseException | None = None
        for r in batch:
            if r.finished_reason is None:
                try:
                    self.finish(r, "error", error)
                except BaseException as e:
                    interrupt = interrupt or e
        if interrupt is not None:
            raise interrupt

    def _each(self, batch: Sequence[Request], step: Callable[[int, Request], None]) -> None:
        """step(i, r) for each unfinished request r = batch[i] of a committed batch. One that
        raises ends that request alone with its error and the others go on (an interrupt ends
        the rest of the batch too, then propagates): no request is left outside every list,
        unreachable by apply_aborts and shutdown, its KV pinned."""
        for i, r in enumerate(batch):
            if r.finished_reason is not None:
                continue
            try:
                step(i, r)
            except Exception as e:
                self.fail([r], e)
            except BaseException as e:
                self.fail(batch[i:], e)
                raise

    def apply_aborts(self) -> None:
        """Aborted requests leave wherever they wait; busy ones once their forward ends."""
        for r in [r for r in self.active() + list(self.waiting) if r.abort_requested]:
            if not r.busy and r.finished_reason is None:
                self.finish(r, "abort")

    # ------------------------------------------------------------ admission and memory

    def admit(self, not_after: float | None = None) -> None:
        """Waiting requests in arrival order (FCFS) while fewer than max_admitted are admitted:
        a place that frees (a request finishes) is taken at the next admission. Not gated by
        the small batch: requests back from catch-ups refill it beyond max_running, and a gate
        there kept the queue out while others came and went (requests waited for
        the whole batch to drain); the batch cap and its longest-waiting-first order
        (schedule_small) share the small model among everyone admitted instead.
        One documented exception to FCFS: a request sharing an uncached prompt page with one
        admitted but not yet prefilled is held back (it then matches that prefill in the tree
        instead of computing it again) and later arrivals pass it meanwhile: it waits for that
        request's first step, its turn in schedule_small's longest-waiting-first order. Nothing
        is admitted after a preemption until a request finishes (no two requests preempting
        each other), nor, in the event loop, past its small clock (not_after)."""
        cfg = self.cfg
        if self.admit_blocked and self.active():
            return
        self.admit_blocked = False
        if not self.waiting or self.num_active() >= cfg.max_admitted:
            return  # nothing to admit, or no place for it
        if not_after is not None and self.waiting[0].submitted_at > not_after:
            return  # the first in line has not arrived yet on this clock
        small_page = self.sides[SMALL].page_size
        held: list[Request] = []
        # Requests whose prefill in the small model has not run to its end (the only ones
        # that can hold anyone back: the index keeps no other), indexed so a burst of
        # arrivals costs a lookup each. Admitted ones join it (not prefilled yet).
        prefilling = PrefillIndex(
            SMALL, small_page, self.running + self.busy if self.holdback else ()
        )
        cached = self._cached_len(SMALL)
        while self.waiting and self.num_active() < cfg.max_admitted:
            r = self.waiting.popleft()
            if not_after is not None and r.submitted_at > not_after:
                self.waiting.appendleft(r)
                break
            if prefilling.holds(r, cached):  # empty, never holding, without the hold-back
                self.stats.held_back += 1
                held.append(r)
                continue
            r.kv = [self.handle_cls(self.sides[SMALL]), self.handle_cls(self.sides[LARGE])]
            if r.admit_order < 0:  # a preempted request keeps its seniority (FCFS victims)
                r.admit_order = self.admitted
                self.admitted += 1
            r.last_small_step = self.stats.steps
            self.running.append(r)
            if self.holdback:
                prefilling.add(r)
        self.waiting.extendleft(reversed(held))  # first in line at the next admission

    def _cached_len(self, kind: int) -> Callable[[Request], int]:
        """How much of a request's prompt this model's tree holds (a shared system prompt that
        is cached already is no reason to hold anyone back)."""
        side = self.sides[kind]

        def cached(r: Request) -> int:
            return side.cached_prefix_len(r.seq[: r.n - 1])

        return cached

    def preempt(self, r: Request) -> None:
        """Drop a request's KV in both models; it is recomputed from its tokens later."""
        self._remove(r)
        self._release(r)
        r.kv = []
        r.held_catchup = r.partial_prefill = False
        self.waiting.appendleft(r)
        self.stats.preemptions += 1
        # No re-admission until a request finishes: otherwise two requests can keep preempting
        # each other. The oldest request is never preempted, so it always makes progress.
        self.admit_blocked = True

    def make_room(
        self,
        side: ModelSide,
        batch: list[Request],
        kind: int,
        need_of: Callable[[list[Request]], int],
        need: int | None = None,
    ) -> None:
        """Evict cached KV, then preempt the newest requests, until the batch's tokens fit
        (need_of(batch): the new KV slots of this step's chunks, Scheduler._plan; need: the
        batch's as given, when the caller planned it already). Raises WaitForMemory when only
        busy requests (a forward running now) could give memory back, MemoryError when
        nothing can."""
        while batch:
            if need is None:
                need = need_of(batch)
            if side.pool.available >= need:
                return
            side.evict(need - side.pool.available)
            if side.pool.available >= need:
                return
            listed = self.active()  # once: per batch row it made this O(batch x active)
            on_list = {id(q) for q in listed}
            active = listed + [r for r in batch if id(r) not in on_list]
            oldest = min(active, key=lambda q: q.admit_order)
            victims = [q for q in active if not q.busy and q is not oldest]
            if not victims:
                if any(q.busy for q in active):
                    raise WaitForMemory
                raise MemoryError(f"{side.name} KV pool too small for one request")
            victim = max(victims, key=lambda q: q.admit_order)
            if victim in batch:
                batch.remove(victim)
            self.preempt(victim)
            need = None  # the batch may have lost a row: planned again

    def _plan(
        self,
        batch: Sequence[Request],
        kind: int,
        after: PreparedForward | None,
        ahead: dict[int, int],
        source: np.ndarray | None = None,
    ) -> RowPlan:
        """Where each row's tokens of this step start and end (chunk_ends under the token
        budget), as arrays: a row continuing the in-flight forward `after` (ahead: id ->
        its row there) takes one token after that row's, or the rest of its prompt after a
        chunk there that stopped short. O(batch) array work; the per-row chunk rule runs only
        when the pending tokens exceed the budget. source: each row's row in `after`, when the
        caller knows it (else from ahead)."""
        n = len(batch)
        handles = [r.kv[kind] for r in batch]
        if not ahead or after is None:
            source = None
        elif source is None:
            source = np.fromiter(map(ahead.get, map(id, batch), repeat(-1)), np.int64, n)
        if source is None or after is None:
            starts = np.fromiter(map(_LENGTH, handles), np.int64, n)
            fulls = np.fromiter(map(_N, batch), np.int64, n)
        elif (source >= 0).all():  # every row continues `after` (steady decoding)
            starts = after.kv_lens[source]
            fulls = starts + 1  # its drawn token, or the rest of a chunked prompt (below)
            if after.any_incomplete:
                for i in after.incomplete[source].nonzero()[0].tolist():
                    fulls[i] = batch[i].n
        else:  # continued rows from `after`'s arrays, only the others from their requests
            starts, fulls = np.empty(n, np.int64), np.empty(n, np.int64)
            cont, fresh = (source >= 0).nonzero()[0], (source < 0).nonzero()[0]
            starts[cont] = after.kv_lens[source[cont]]
            fulls[cont] = starts[cont] + 1  # its drawn token, or the rest of a chunked prompt
            for i in cont[after.incomplete[source[cont]]].tolist():
                fulls[i] = batch[i].n
            if len(fresh):
                idx = fresh.tolist()
                starts[fresh] = np.fromiter((handles[i].length for i in idx), np.int64, len(idx))
                fulls[fresh] = np.fromiter((batch[i].n for i in idx), np.int64, len(idx))
        budget = self.cfg.token_budget(kind)
        ends = fulls
        if 0 < budget < int((fulls - starts).sum()):
            chunked = chunk_ends(batch, kind, budget, starts.tolist(), fulls.tolist())
            ends = np.asarray(chunked, dtype=np.int64)
        return RowPlan(handles, starts, fulls, ends, source)

    def _prepare(
        self,
        batch: list[Request],
        kind: int,
        deferred: list[Request],
        after: PreparedForward | None = None,
        ahead: dict[int, int] | None = None,
        source: np.ndarray | None = None,
    ) -> PreparedForward | None:
        """Attach, make room and allocate; the batch becomes busy. Requests the token budget
        gives nothing this step leave the batch for `deferred` (the caller lists them again;
        one continuing `after` is not listed: it stays busy there, and goes on once that
        finishes). ahead: id(request) -> its row in the in-flight forward `after` it
        continues (those are busy already); source: each row's row there (-1: none), when the
        caller knows it. On an allocator or tree error the batch fails (released), never
        leaks."""
        side = self.sides[kind]
        ahead = ahead or {}
        try:
            if len(ahead) < len(batch):  # else every row continues `after` (ahead is a part
                # of batch here): attached there
                attach_all(batch if not ahead else [r for r in batch if id(r) not in ahead], kind)
            plan = self._plan(batch, kind, after, ahead, source)
            if side.pool.available < plan.need:  # evict, or preempt (rare: plan again after)
                rows = len(batch)
                self.make_room(
                    side, batch, kind, lambda b: self._plan(b, kind, after, ahead).need, plan.need
                )
                if len(batch) != rows:  # a row was preempted; eviction changes no row's plan
                    plan = self._plan(batch, kind, after, ahead)
            run = plan.ends > plan.starts
            if not run.all():  # the token budget gives these nothing this step
                for i in (~run).nonzero()[0].tolist():
                    r = batch[i]
                    if ahead.pop(id(r), None) is None:
                        deferred.append(r)
                batch[:] = [batch[i] for i in run.nonzero()[0].tolist()]
                plan = plan.take(run)
            if not batch:
                return None
            prep = prepare_forward(side, batch, kind, plan, after)
        except WaitForMemory:
            raise
        except Exception as e:
            self.fail(batch + deferred, e)
            deferred.clear()
            return None
        if plan.source is None:
            fresh = batch
        else:
            new_rows = (plan.source < 0).nonzero()[0]
            if not len(new_rows):  # every row continues `after`: busy there already
                return prep
            fresh = [batch[i] for i in new_rows.tolist()]
        for r in fresh:
            r.busy_model = kind
        self.busy += fresh
        return prep

    # ------------------------------------------------------------ small model

    def schedule_small(self, after: PreparedForward | None = None) -> PreparedForward | None:
        """At most max_running ready requests, those that waited longest first. More are
        ready than the cap when requests back from a catch-up find their places refilled
        (admission fills max_admitted): the most recently stepped wait a step rather than
        overfill the batch, so nobody waits more than about ready / max_running steps.
        after: the small step launched and not finished yet (overlap): its requests, which
        stepped last, fill the places left and continue it with its drawn token (a request
        whose drawn token is certainly its last does not) or, a prompt chunked there, with
        the next chunk; those it parks or ends are then dropped from this step
        (PreparedForward.dropped)."""
        ready = sorted(
            [r for r in self.running if r.busy_model == -1],  # not busy (no call per request)
            key=_STEP_ORDER,
        )
        cap = self.cfg.max_running
        batch = ready[:cap]
        ahead: dict[int, int] = {}
        if len(batch) == len(self.running):  # all of it (batch is a part of it)
            self.running = []
        elif batch:  # the ready ones leave the running list (a busy request is never on it)
            chosen = {id(r) for r in batch}
            self.running = [r for r in self.running if id(r) not in chosen]
        source = None  # each row's row in `after` (-1: none), once a row continues it
        if after is not None and len(batch) < cap:
            # A chunk short of its end goes on with the next chunk; a drawn token, when there
            # is room for one after it (its place is kv_lens: the step before `after` is
            # committed). As arrays: this runs once per request per step.
            prev = after.batch
            goes_on = after.kv_lens + 1 < after.facts.limit
            if after.any_incomplete:
                goes_on |= after.incomplete
            goes_on &= np.fromiter(
                (r.finished_reason is None and not r.abort_requested for r in prev),
                np.bool_,
                len(prev),
            )
            if after.dropped:
                goes_on[list(after.dropped)] = False
            rows = goes_on.nonzero()[0][: cap - len(batch)]
            if len(rows):
                if len(rows) == len(prev):
                    went_on: Sequence[Request] = prev
                else:
                    went_on = [prev[i] for i in rows.tolist()]
                ahead = dict(zip(map(id, went_on), rows.tolist(), strict=True))
                if batch:
                    source = np.full(len(batch) + len(rows), -1, np.int64)
                    source[len(batch) :] = rows
                else:  # only `after`'s rows (steady decoding): their rows there
                    source = rows
                batch += went_on
        if not batch:
            return None
        deferred: list[Request] = []  # left out by the token budget: next step, first
        try:
            prep = self._prepare(batch, SMALL, deferred, after, ahead, source)
        except WaitForMemory:
            self.running += [r for r in batch if id(r) not in ahead]
            raise
        self.running += deferred
        if prep is not None:
            for r in prep.batch:  # after a memory wait they keep their turn
                r.last_small_step = self.stats.steps
            # What could run: every admitted unfinished request (the batch is busy now), up to
            # the batch target (a parked request whose place was refilled leaves no hole).
            could_run = min(self.cfg.max_running, self.num_active())
            self.stats.small_batch_sizes.append(len(prep.batch))
            self.stats.small_batch_capacity.append(max(could_run, len(prep.batch)))
            if self.parked and self.cfg.launch == "cost":
                self._charge_holes(prep, could_run)
        return prep

    def finish_small(self, prep: PreparedForward, out: ForwardOutput, now: float) -> list[Request]:
        """Commit the KV, route, then per request: park (escalated), append its token, or
        finish; a request whose prefill chunk stopped short only commits its KV and steps
        again. Returns the escalated requests. A request that continues in the step launched
        after this one (overlap) stays busy there; one parked or ended here is dropped from
        it."""
        st = self.stats
        nxt, prep.successor = prep.successor, None
        cont: dict[int, int] = {}  # id(request) -> its row in nxt
        rows_there: list[int] = []  # nxt's rows that continue this step's, in batch order
        if nxt is not None and nxt.ahead is not None:
            rows_there = nxt.ahead.nonzero()[0].tolist()
        # Every row continues in nxt (steady overlapped decoding): no id() per request below,
        # and cont is made only once a row leaves nxt (prep.batch is nxt's continuing rows, in
        # order). Only a row's own leaving (leave_next) takes it out of cont, so for every
        # other row "in cont" stays true.
        all_continue = len(rows_there) == len(prep.batch)
        if rows_there and not all_continue:
            went_on = [nxt.batch[i] for i in rows_there] if nxt is not None else []
            cont = dict(zip(map(id, went_on), rows_there, strict=True))
        live = prep.live()
        if all_continue:
            done = []
        elif cont:
            done = [r for r, ok in zip(prep.batch, live, strict=True) if ok and id(r) not in cont]
        else:  # nothing continues (no overlap): no id() per request
            done = [r for r, ok in zip(prep.batch, live, strict=True) if ok]
        self._unbusy(done)  # those continuing in nxt stay busy there
        parked: list[Request] = []

        def leave_next(r: Request) -> None:
            """r will not continue in nxt: its row there is dropped, it is not busy."""
            if all_continue and not cont and rows_there:  # the first to leave: cont made now
                cont.update(zip(map(id, prep.batch), rows_there, strict=True))
                rows_there.clear()
            row = cont.pop(id(r), None)
            if row is not None and nxt is not None:
                nxt.dropped.add(row)
                self._unbusy([r])

        try:
            prep.commit(live)
            st.steps += 1
            kept = sum(live)
            if kept == len(live):
                st.small_tokens += prep.num_tokens
            else:
                decode = prep.num_tokens == len(live)  # a token a row: the live rows' count
                st.small_tokens += kept if decode else int(np.diff(prep.q_off)[live].sum())
                st.dropped_rows += len(live) - kept
            for r in self._partial(prep, live):  # a chunk short of its end: the next is due
                if r.finished_reason is not None:
                    continue
                if all_continue or id(r) in cont:  # it runs in nxt, unless aborted meanwhile
                    if not r.abort_requested:
                        continue
                    leave_next(r)
                self.running.append(r)
            batch, sel = prep.complete(out)
            rows = (~prep.incomplete).nonzero()[0].tolist()
            drawn = prep.drawn
            if drawn is None:  # run() rather than launch(): drawn here
                drawn = prep.drawn = draw(
                    out.logits, prep.batch, prep.kv_lens, prep.facts.sampled, out.greedy
                )
            decided = prep.decided
            if decided is None:
                index = prep.kv_lens[~prep.incomplete]
                toks = drawn.tokens[torch.as_tensor(rows, device=drawn.tokens.device)]
                decided = route(self.router, sel, batch, toks, index)
            answers = decided.resolve()
            tokens, failed = drawn.resolve(prep.batch)
            escalate = answers  # one answer per row unless a chunk stopped short
            if len(rows) < len(prep.batch):
                escalate = [False] * len(prep.batch)
                for k, i in enumerate(rows):
                    escalate[i] = answers[k]
            prep.resolved = np.asarray(tokens, dtype=np.int64)
        except BaseException as e:
            self.abandon(prep, e, live)
            if not isinstance(e, Exception):
                raise
            return []

        # The rows to finish: not a chunk short of its end, not dropped, not ended meanwhile.
        # Sorted out as arrays, then in three passes: the failed (their row could not be
        # sampled: each ends alone, with that), the parked (escalated: the small token is
        # discarded and never fed), and those that take their token, delivered under one
        # acquire of the delivery lock (this runs once per request per small step). As in
        # _each, a row that raises ends alone; an interrupt ends every row not yet handled.
        batch = prep.batch
        fail_rows: list[int] = []
        park_rows: list[int] = []
        takers: Sequence[Request] = batch
        taken = tokens
        if failed or any(escalate) or not all(live) or prep.any_incomplete:
            ok = np.asarray(live, dtype=np.bool_) & ~prep.incomplete
            esc = np.asarray(escalate, dtype=np.bool_)
            fail_rows = [i for i in failed if ok[i] and batch[i].finished_reason is None]
            ok[fail_rows] = False
            park_rows = (ok & esc).nonzero()[0].tolist()
            rows = (ok & ~esc).nonzero()[0].tolist()
            takers, taken = [batch[i] for i in rows], [tokens[i] for i in rows]
        shared = self.delivery_lock
        stage = k = count = 0  # the pass and its row reached, for an interrupt
        try:
            for k, i in enumerate(fail_rows):  # noqa: B007 (k: read on an interrupt)
                self.fail([batch[i]], failed[i])
                leave_next(batch[i])
            stage, k = 1, 0
            for k, i in enumerate(park_rows):  # noqa: B007 (k: read on an interrupt)
                r = batch[i]
                if r.finished_reason is not None:
                    continue
                try:
                    leave_next(r)
                    r.kv[SMALL].park(r.seq)
                    r.parked_at = now
                    parked.append(r)
                    st.escalations += 1
                except Exception as e:
                    self.fail([r], e)
                    leave_next(r)
            stage, k = 2, 0
            with shared:
                ends = end_reasons(takers, taken)  # before the tokens are appended
                for k, r in enumerate(takers):
                    if r.finished_reason is not None:
                        continue
                    try:
                        token = taken[k]
                        n = r.n
                        r.seq[n] = token
                        r.n = n + 1
                        count += 1
                        reason = ends[k]
                        if r.lock is shared:  # _deliver, inline
                            if not r.abort_requested:
                                r.tokens.append(token)
                                r.token_models.append(SMALL)
                                r.token_times.append(now)
                                r.ending = reason
                        else:  # a request made outside an engine keeps its own lock
                            with r.lock:
                                self._deliver(r, token, SMALL, now, reason)
                        self.touched.append(r)
                        if reason is not None or r.abort_requested:
                            self.finish(r, reason or "abort")
                            leave_next(r)
                        elif not all_continue and id(r) not in cont:
                            self.running.append(r)
                    except Exception as e:
                        self.fail([r], e)
                        leave_next(r)
        except BaseException as e:
            rest = [batch[i] for i in fail_rows[k:]] if stage == 0 else []
            rest += [batch[i] for i in park_rows[k if stage == 1 else 0 :]] if stage <= 1 else []
            rest += list(takers[k if stage == 2 else 0 :])
            self.fail(rest, e)
            raise
        finally:
            st.tokens += count
            self.parked += [r for r in parked if r.finished_reason is None]
        return parked

    # ------------------------------------------------------------ large model

    def schedule_large(self) -> PreparedForward | None:
        """Every parked request (barrier) or the next catch-up batch (hold-back applied)."""
        if not self.parked:
            return None
        if self.barrier:
            batch, rest, held = list(self.parked), list[Request](), list[Request]()
        else:
            cap = self.cfg.max_large_batch or len(self.parked)
            page = self.sides[LARGE].page_size
            cached = self._cached_len(LARGE)
            batch, rest, held = take_catchup_batch(self.parked, cap, LARGE, page, cached)
        self.parked = rest
        deferred: list[Request] = []  # left out by the token budget: the next catch-up's
        try:
            prep = self._prepare(batch, LARGE, deferred)
        except WaitForMemory:
            for r in held:  # not launched: they were not held behind a computed prefill
                r.held_catchup = False
            self.parked = batch + self.parked
            raise
        self.parked = deferred + self.parked
        if prep is not None:
            self.stats.large_held_back += len(held)
            self.hole_loss_s = 0.0  # ski rental: bought; the holes from here on count anew
            self._large_cached.clear()
        return prep

    def finish_large(self, prep: PreparedForward, out: ForwardOutput, now: float) -> list[Request]:
        """Commit the catch-up and each request's large token; returns those that go on. A
        request whose catch-up chunk stopped short stays parked (first in line) for the next
        catch-up: it rejoins the small model once its last chunk ran."""
        st = self.stats
        self._unbusy(prep.batch)
        try:
            prep.commit()
            self.parked[:0] = self._partial(prep)
            if prep.drawn is None:  # run() rather than launch(): drawn here
                prep.drawn = draw(
                    out.logits, prep.batch, prep.kv_lens, prep.facts.sampled, out.greedy
                )
            tokens, failed = prep.drawn.resolve(prep.batch)
        except BaseException as e:
            self.abandon(prep, e)
            if not isinstance(e, Exception):
                raise
            return []
        st.catchup_batch_sizes.append(len(prep.batch))
        st.catchup_tokens.append(prep.num_tokens)
        st.catchup_kv_tokens.append(int(prep.kv_lens.sum()))
        st.catchup_shared_prefix.append(prep.shared_prefix)
        back: list[Request] = []

        def step(i: int, r: Request) -> None:
            if prep.incomplete[i]:  # a chunk short of its end: parked for the next catch-up
                return
            if i in failed:
                raise failed[i]
            r.kv[LARGE].park(r.seq)
            if not self.commit_token(r, tokens[i], LARGE, now):
                back.append(r)

        try:
            self._each(prep.batch, step)
        except BaseException:
            self.running += back  # the driver never sees them: they step on from here
            raise
        return back

    def abandon(
        self, prep: PreparedForward, error: BaseException, live: list[bool] | None = None
    ) -> None:
        """A forward, its commit or its routing raised: new slots not yet committed go back and
        the batch's live requests fail (released); rows dropped from it (overlap) belong to
        requests that left it before and are not touched."""
        live = prep.live() if live is None else live
        rows = [r for r, ok in zip(prep.batch, live, strict=True) if ok]
        self._unbusy(rows)
        prep.discard()
        prep.successor = None  # the rows continued there end here: it commits none of them
        if prep.after is not None and prep.after.successor is prep:
            prep.after.successor = None  # nothing of it continues here
        prep.after = None
        self.fail(rows, error)

    def _partial(self, prep: PreparedForward, live: list[bool] | None = None) -> list[Request]:
        """The requests of a committed forward whose chunk stopped short of their last token
        (marked partial_prefill, the others unmarked): they go on at the next step. Only live
        rows (live: the caller's prep.live()): a row dropped from the forward (overlap: its
        request left it, aborted, before it finished) belongs to a request that is elsewhere
        by now, listed once already."""
        out: list[Request] = []
        short = None  # the live rows short of their end, when any row is
        if prep.any_incomplete:
            short = prep.incomplete if live is None else prep.incomplete & np.asarray(live)
        if short is None or not short.any():  # every chunk ran to its end: unmark, list none
            for i, r in enumerate(prep.batch):
                if r.partial_prefill and (live is None or live[i]):
                    r.partial_prefill = False
            return out
        for i, r in enumerate(prep.batch):
            if live is None or live[i]:
                r.partial_prefill = bool(short[i])
                if short[i]:
                    out.append(r)
        if out:
            st = self.stats
            st.prefill_chunks += len(out)
            if prep.side is self.sides[LARGE]:
                st.catchup_partial_rows += len(out)
                st.catchup_partial_kv_tokens += int(prep.kv_lens[short].sum())
        return out

    def _unbusy(self, batch: Sequence[Request]) -> None:
        for r in batch:
            r.busy_model = -1
        if len(batch) <= 4:  # a few rows (none, with overlap, most steps): found where they are
            for r in batch:
                if r in self.busy:
                    self.busy.remove(r)
            return
        # Many: one pass, no call per request: busy holds exactly the requests whose busy_model
        # is set (_prepare sets both, only this clears them).
        self.busy[:] = [r for r in self.busy if r.busy_model != -1]

    # ------------------------------------------------------------ tokens

    def commit_token(self, r: Request, token: int, model: int, now: float) -> bool:
        """Appends a token and hands it to the caller; True when r finished (released)."""
        (reason,) = end_reasons((r,), (token,))  # before the token is appended
        n = r.n
        r.seq[n] = token
        r.n = n + 1
        st = self.stats
        st.tokens += 1
        if model == LARGE:
            st.large_tokens += 1
        with r.lock:
            self._deliver(r, token, model, now, reason)
        self.touched.append(r)
        if reason is not None or r.abort_requested:
            self.finish(r, reason or "abort")
            return True
        return False

    @staticmethod
    def _deliver(r: Request, token: int, model: int, now: float, reason: str | None) -> None:
        """Under r's lock: nothing is delivered after abort() returned; once its last token is
        (reason set), abort() is a no-op."""
        if not r.abort_requested:
            r.tokens.append(token)
            r.token_models.append(model)
            r.token_times.append(now)
            r.ending = reason

    def take_touched(self) -> list[Request]:
        out, self.touched = self.touched, []
        return out
