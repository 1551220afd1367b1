"""RoutedEngine: a deterministic single-threaded event loop interleaving a small and a large model.

Per request, one KV handle per model (a tokencache Cursor, or the naive SGLang-style protocol).
Each loop iteration runs one small-model step over the requests it holds and, when the delayed
batching policy says so, one large-model catch-up batch over parked requests. With
dispatch="tokencache" the two run side by side (no barrier: the small model keeps decoding the
others); with dispatch="naive" or "naive-sglang" every step waits for the large model
(synchronous barrier).
Time on two devices is modelled from the measured forward times (CPU runs them in turn).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokencache_models import CausalLM, ForwardOutput, KVPool

from .batch import (
    Request,
    attach_all,
    overlaps_prefill,
    route_step,
    run_forward,
    take_catchup_batch,
    tokens_needed,
)
from .kv import CursorKV, ModelSide
from .naive import NaiveKV
from .routers import Router
from .scheduler import SchedulerConfig
from .workers import run_threaded

SMALL, LARGE = 0, 1
# "naive-sglang": the naive protocol through SGLang's own RadixCache (naive_sglang.py).
DISPATCHES = ("tokencache", "naive", "naive-sglang")
_Request = Request  # the old private name


@dataclass
class Stats:
    steps: int = 0
    tokens: int = 0
    escalations: int = 0
    preemptions: int = 0
    aborted: int = 0  # requests stopped by RoutedEngine.abort while the engine still held them
    wall_s: float = 0.0
    small_forward_s: float = 0.0
    large_forward_s: float = 0.0
    bookkeeping_s: float = 0.0  # inside tokencache calls (tree and cursor operations)
    small_tokens: int = 0  # tokens the small model computed (prefills, catch-ups and decodes)
    held_back: int = 0  # admissions delayed a step so a shared prefix is prefilled once
    large_held_back: int = 0  # first catch-ups held a batch so a shared prefix is prefilled once
    modeled_s: float = 0.0  # two devices: the models overlap unless there is a barrier
    small_idle_s: float = 0.0  # modelled time the small model waits for the large one
    catchup_batch_sizes: list[int] = field(default_factory=list)
    catchup_tokens: list[int] = field(default_factory=list)  # tokens prefilled per catch-up

    @property
    def bookkeeping_share(self) -> float:
        busy = self.small_forward_s + self.large_forward_s + self.bookkeeping_s
        return self.bookkeeping_s / busy if busy else 0.0

    @property
    def small_idle_share(self) -> float:
        return self.small_idle_s / self.modeled_s if self.modeled_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def modeled_tokens_per_s(self) -> float:
        return self.tokens / self.modeled_s if self.modeled_s else 0.0


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    models: list[list[int]]  # per token: 0 = small model, 1 = large model
    texts: list[str] | None
    stats: Stats
    # per request: "length" (max_new_tokens), "stop" (eos) or "abort" (RoutedEngine.abort; its
    # tokens are those delivered before the abort)
    finished_reasons: list[str] = field(default_factory=list)

    @property
    def aborted(self) -> list[bool]:
        return [f == "abort" for f in self.finished_reasons]


class RoutedEngine:
    def __init__(
        self,
        small: CausalLM,
        large: CausalLM,
        router: Router,
        num_slots: int = 8192,
        large_num_slots: int | None = None,
        dispatch: str = "tokencache",
        scheduler: SchedulerConfig | None = None,
        tokenizer: Any = None,
        eos_token_id: int | None = None,
        page_size: int = 1,
        clock: str = "steps",
        large_step_cost: float = 1.0,
        mode: str = "events",
    ) -> None:
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {', '.join(map(repr, DISPATCHES))}")
        if mode not in ("events", "threaded"):
            raise ValueError("mode must be 'events' (deterministic) or 'threaded'")
        if mode == "threaded" and dispatch != "tokencache":
            raise ValueError("mode='threaded' needs dispatch='tokencache' (naive has a barrier)")
        # mode="threaded": one worker thread per model (workers.py), really overlapping; the
        # event loop stays the default because its schedules are reproducible.
        self.mode = mode
        if small.config.vocab_size != large.config.vocab_size:
            raise ValueError("small and large models must share a vocabulary")
        if clock not in ("steps", "measured"):
            raise ValueError("clock must be 'steps' (deterministic) or 'measured'")
        # clock="steps": a small step costs 1 and a catch-up large_step_cost, so schedules (not
        # just tokens) are reproducible; "measured" uses the measured step times (benchmarks).
        self.clock = clock
        self.large_step_cost = large_step_cost
        self.router = router
        self.dispatch = dispatch
        self.sched = scheduler or SchedulerConfig()
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        n_large = large_num_slots or num_slots
        side_cls: type[ModelSide] = ModelSide
        self._handle_cls: type = CursorKV if dispatch == "tokencache" else NaiveKV
        if dispatch == "naive-sglang":
            from .naive_sglang import NaiveSGLangKV, SGLangSide  # imports sglang

            side_cls, self._handle_cls = SGLangSide, NaiveSGLangKV
        self.sides = (
            side_cls("small", small, small.make_kv_pool(num_slots), page_size),
            side_cls("large", large, large.make_kv_pool(n_large), page_size),
        )
        # abort(): the current stream's requests; what the caller has been given or cut off
        self._abort_lock = threading.Lock()
        self._reqs: list[Request] | None = None
        self._aborted: set[int] = set()  # aborted by the caller: no further events
        self._done: set[int] = set()  # last token delivered to the caller
        self._delivered: list[int] = []
        self._abort_queue: list[int] = []  # event loop: applied at the top of each iteration
        self._wake_workers: Callable[[], None] | None = None  # threaded: set by run_threaded

    @property
    def small(self) -> ModelSide:
        return self.sides[SMALL]

    @property
    def large(self) -> ModelSide:
        return self.sides[LARGE]

    def pools(self) -> tuple[KVPool, KVPool]:
        return self.small.pool, self.large.pool

    def idle_invariant(self) -> bool:
        return all(s.idle_invariant() for s in self.sides)

    # ---------------------------------------------------------------- public API

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> GenerateResult:
        tokens: list[list[int]] = [[] for _ in prompts]
        models: list[list[int]] = [[] for _ in prompts]
        self.stats = Stats()
        for rid, tok, model in self.stream(prompts, max_new_tokens):
            tokens[rid].append(tok)
            models[rid].append(model)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t) for t in tokens]
        reasons = [
            "abort"
            if rid in self._aborted
            else "stop"
            if t and t[-1] == self.eos_token_id
            else "length"
            for rid, t in enumerate(tokens)
        ]
        return GenerateResult(tokens, models, texts, self.stats, reasons)

    def abort(self, rid: int) -> bool:
        """Stops request `rid` (its index in the prompts) of the current stream: no further
        events for it, its KV released in both models (cached prefix stays in the trees). Callable
        between events, from the router or another thread. Returns False (a no-op) when the
        request's last token was already delivered or it was already aborted; raises ValueError
        for an index outside the stream and RuntimeError when no stream has started."""
        reqs = self._reqs
        if reqs is None:
            raise RuntimeError("abort: no stream has started on this engine")
        if not isinstance(rid, int) or not 0 <= rid < len(reqs):
            raise ValueError(f"abort: unknown request {rid!r} (the stream has {len(reqs)})")
        with self._abort_lock:
            if rid in self._done or rid in self._aborted:
                return False
            self._aborted.add(rid)
            reqs[rid].aborted = True  # read by the threaded workers
            self._abort_queue.append(rid)
            wake = self._wake_workers
        if wake is not None:
            wake()
        return True

    def stream(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> Iterator[tuple[int, int, int]]:
        """Yields (request index, token, model) as tokens are committed; stats in self.stats.
        `abort(rid)` stops a request: no event for it is yielded after the call."""
        reqs = [_Request(i, p, max_new_tokens) for i, p in enumerate(prompts)]
        with self._abort_lock:
            self._reqs = reqs
            self._aborted, self._done, self._abort_queue = set(), set(), []
            self._delivered = [0] * len(reqs)
            self._wake_workers = None
        inner = self._run(reqs, max_new_tokens)
        try:
            for ev in inner:
                rid, tok = ev[0], ev[1]
                with self._abort_lock:
                    if rid in self._aborted:
                        continue
                    self._delivered[rid] += 1
                    if self._delivered[rid] >= max_new_tokens or tok == self.eos_token_id:
                        self._done.add(rid)
                yield ev
            with self._abort_lock:
                self._done.update(range(len(reqs)))
        finally:
            inner.close()  # an abandoned stream still joins the threaded mode's workers

    def _run(self, reqs: list[Request], max_new_tokens: int) -> Iterator[tuple[int, int, int]]:
        self.stats = st = Stats()
        for s in self.sides:
            s.bookkeeping_s = 0.0
        self._max_new = max_new_tokens
        self._waiting: deque[_Request] = deque(reqs)
        self._running: list[_Request] = []  # on the small side
        self._parked: list[_Request] = []  # waiting for the large model
        self._small_batch: list[_Request] = []
        self._large_batch: list[_Request] = []
        self._inflight: list[_Request] = []  # catch-up computed, token not yet delivered
        self._admit_blocked = False
        self._admitted = 0
        t_start = time.perf_counter()
        if max_new_tokens <= 0:
            return
        if self.mode == "threaded":
            yield from run_threaded(self, reqs, max_new_tokens, st)
            st.wall_s = time.perf_counter() - t_start
            st.bookkeeping_s = sum(s.bookkeeping_s for s in self.sides)
            st.modeled_s = st.wall_s  # real overlap: the measured time is the two-device time
            return
        # Two device clocks. A catch-up batch is computed when it launches (the CPU runs the
        # models in turn) but its requests rejoin the small side only once the large model's
        # clock says it finished; meanwhile the small model keeps stepping the others.
        t_small = t_large = done_at = 0.0
        while self._waiting or self._running or self._parked or self._inflight:
            self._apply_aborts()
            if self._inflight and done_at <= t_small:
                self._running += self._inflight
                self._inflight = []
            self._admit()
            events: list[tuple[int, int, int]] = []
            if self.dispatch != "tokencache":  # both naive dispatches
                if self._parked:  # synchronous barrier: the small model waits for every catch-up
                    self._large_batch, self._parked = self._parked, []
                    d_large = self._cost(self._large_step, events, LARGE)
                    st.small_idle_s += d_large
                    t_small += d_large
                if self._running:
                    t_small += self._cost(self._small_step, events, SMALL)
                t_large = t_small
            else:
                wait = st.steps - self._parked[0].parked_at if self._parked else 0
                has_work = bool(self._running)
                if not self._inflight and self.sched.launch_large(
                    len(self._parked), wait, has_work
                ):
                    cap = self.sched.max_large_batch or len(self._parked)
                    self._large_batch, self._parked, held = take_catchup_batch(
                        self._parked, cap, LARGE, self.large.tree.page_size
                    )
                    st.large_held_back += len(held)
                    returning = list(self._large_batch)
                    d_large = self._cost(self._large_step, events, LARGE)
                    done_at = t_large = max(t_large, t_small) + d_large
                    self._inflight = [r for r in returning if r in self._running]
                    self._running = [r for r in self._running if r not in self._inflight]
                if self._running:
                    t_small += self._cost(self._small_step, events, SMALL)
                elif self._inflight:  # nothing else to run: idle until the catch-up is back
                    st.small_idle_s += done_at - t_small
                    t_small = done_at
            yield from events
        st.wall_s = time.perf_counter() - t_start
        st.bookkeeping_s = sum(s.bookkeeping_s for s in self.sides)
        st.modeled_s = max(t_small, t_large)

    def _cost(
        self,
        step: Callable[[list[tuple[int, int, int]]], float],
        events: list[tuple[int, int, int]],
        kind: int,
    ) -> float:
        """Runs a step; its duration on the modelled clock (measured, or fixed step units)."""
        t0 = time.perf_counter()
        ran = step(events)
        if self.clock == "measured":
            return time.perf_counter() - t0
        if not ran:
            return 0.0
        return 1.0 if kind == SMALL else self.large_step_cost

    # ---------------------------------------------------------------- internals

    def _apply_aborts(self) -> None:
        """Event loop: drop aborted requests wherever they wait (admission, the small side,
        parked, a catch-up in flight) and release their KV in both models."""
        with self._abort_lock:
            rids, self._abort_queue = self._abort_queue, []
        for rid in rids:
            r = self._reqs[rid]  # type: ignore[index]
            held = False
            for lst in (self._waiting, self._running, self._parked, self._inflight):
                if r in lst:
                    lst.remove(r)
                    held = True
            if not held:  # finished already (its last events not yet delivered)
                continue
            for h in r.kv:  # never admitted or preempted: no handles, or released ones
                h.release(r.seq)
            self.stats.aborted += 1
            self._admit_blocked = False  # memory came back, as when a request finishes

    def _admit(self) -> None:
        if self._admit_blocked and (self._running or self._parked or self._inflight):
            return
        self._admit_blocked = False
        while (
            self._waiting
            and len(self._running) + len(self._parked) + len(self._inflight)
            < self.sched.max_running
        ):
            r = self._waiting[0]
            if self.dispatch == "tokencache" and overlaps_prefill(
                r, self._running, SMALL, self.small.tree.page_size
            ):
                self.stats.held_back += 1
                break
            self._waiting.popleft()
            r.kv = [self._handle_cls(self.small), self._handle_cls(self.large)]
            r.admit_order = self._admitted
            self._admitted += 1
            self._running.append(r)

    def _preempt(self, r: _Request) -> None:
        """Drop a request's KV in both models; it is recomputed from its tokens later."""
        for h in r.kv:
            h.release(r.seq)
        lists = (self._running, self._parked, self._inflight, self._small_batch, self._large_batch)
        for lst in lists:
            if r in lst:
                lst.remove(r)
        self._waiting.appendleft(r)
        self.stats.preemptions += 1
        # No re-admission until a request finishes: otherwise two requests can keep preempting
        # each other. The oldest request is never preempted, so it always makes progress.
        self._admit_blocked = True

    def _make_room(self, side: ModelSide, batch: list[_Request], kind: int) -> None:
        """Evict cached KV, then preempt the newest requests, until the batch's tokens fit."""
        while batch:
            need = tokens_needed(batch, kind)
            if side.pool.available >= need:
                return
            side.evict(need - side.pool.available)
            if side.pool.available >= need:
                return
            pool = (
                self._running
                + self._parked
                + self._inflight
                + self._large_batch
                + self._small_batch
            )
            active = list({id(q): q for q in pool}.values())
            if len(active) <= 1:
                raise MemoryError(f"{side.name} KV pool too small for one request")
            self._preempt(max(active, key=lambda q: q.admit_order))

    def _forward(
        self, side: ModelSide, batch: list[_Request], kind: int
    ) -> tuple[ForwardOutput, float, int] | None:
        attach_all(batch, kind)
        self._make_room(side, batch, kind)
        if not batch:
            return None
        return run_forward(side, batch, kind)

    def _commit_token(
        self, r: _Request, token: int, model: int, events: list[tuple[int, int, int]]
    ) -> bool:
        """Appends a token; returns True when the request finished (handles released)."""
        r.seq[r.n] = token
        r.n += 1
        r.models.append(model)
        self.stats.tokens += 1
        events.append((r.rid, token, model))
        if r.num_generated >= self._max_new or token == self.eos_token_id:
            for h in r.kv:
                h.release(r.seq)
            self._admit_blocked = False
            return True
        return False

    def _small_step(self, events: list[tuple[int, int, int]]) -> float:
        self._small_batch = batch = list(self._running)
        res = self._forward(self.small, batch, SMALL) if batch else None
        if res is None:
            return 0.0
        out, dt, ntok = res
        self.stats.small_tokens += ntok
        self.stats.steps += 1
        self.stats.small_forward_s += dt
        tok, escalate = route_step(self.router, out, batch)
        keep: list[_Request] = []
        for r, t, esc in zip(batch, tok.tolist(), escalate, strict=True):
            if esc:  # park: the small token is discarded and never fed
                r.kv[SMALL].park(r.seq)
                r.parked_at = self.stats.steps
                self._parked.append(r)
                self.stats.escalations += 1
            elif not self._commit_token(r, t, SMALL, events):
                keep.append(r)
        stepped = set(map(id, batch))
        # Requests admitted or returned during this step stay in line behind the stepped ones.
        self._running = keep + [r for r in self._running if id(r) not in stepped]
        self._small_batch = []
        return dt

    def _large_step(self, events: list[tuple[int, int, int]]) -> float:
        batch = self._large_batch
        res = self._forward(self.large, batch, LARGE) if batch else None
        if res is None:
            self._large_batch = []
            return 0.0
        out, dt, ntok = res
        self.stats.large_forward_s += dt
        self.stats.catchup_batch_sizes.append(len(batch))
        self.stats.catchup_tokens.append(ntok)
        for r, t in zip(batch, out.logits.argmax(-1).tolist(), strict=True):
            r.kv[LARGE].park(r.seq)
            if not self._commit_token(r, t, LARGE, events):
                self._running.append(r)
        self._large_batch = []
        return dt
