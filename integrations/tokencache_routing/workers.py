"""Threaded mode: one worker thread per model, queues between them, no global barrier.

The small worker admits requests, decodes every request it holds and routes; an escalated
request is parked (its cursors stay) and handed to the large worker's queue. The large worker
batches parked requests (min batch / max wait in seconds), catches each up over the tokens
written since its own cursor in one extend, commits the large token and hands the request back.
Each model's tree and pool are touched only by that model's worker, so a request's KV in the
other model is released by a message to that worker (FIFO queues keep the order right).
tokencache releases the GIL in bulk calls and torch releases it in ops: the models overlap.

Abort (RoutedEngine.abort): the caller flags the request and wakes both workers; whichever
holds it drops it at its next loop (the large worker releases its large KV and hands it to the
small worker as finished; the small worker releases its small KV, asks the large worker to
release the large one, and reports it done). Tokens committed meanwhile are filtered out by the
engine's stream.

Memory: evict cached KV, then preempt the newest request the worker holds. A worker whose only
request is the globally oldest one waits for the other worker to free memory instead; the other
worker never waits on a request that is not the oldest, so one of the two always moves.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .engine import RoutedEngine, Stats

SMALL, LARGE = 0, 1
_STOP = ("stop", None)
_POLL_S = 0.05  # how often a waiting worker looks at the stop flag
_JOIN_S = 30.0


class _Shared:
    """What both workers and the caller see; every field is thread-safe or guarded by lock."""

    def __init__(self, eng: RoutedEngine, st: Stats, max_new: int) -> None:
        self.eng = eng
        self.st = st
        self.max_new = max_new
        self.lock = threading.Lock()
        self.active: set[int] = set()  # admit orders of admitted, unfinished requests
        self.stop = threading.Event()  # set on a worker error
        self.small_idle = threading.Event()  # the small model has nothing it can run
        self.small_in: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.large_in: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.out: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def is_oldest(self, r: Request) -> bool:
        with self.lock:
            return r.admit_order == min(self.active)

    def only_active(self, r: Request) -> bool:
        with self.lock:
            return self.active == {r.admit_order}

    def count_preemption(self) -> None:
        with self.lock:
            self.st.preemptions += 1

    def count_abort(self) -> None:
        with self.lock:
            self.st.aborted += 1

    def wake(self) -> None:
        """An abort came in: both workers look at the requests they hold."""
        self.small_in.put(("abort", None))
        self.large_in.put(("abort", None))

    def commit(self, r: Request, token: int, model: int) -> bool:
        """Appends a token (by the worker that holds r); True when r is finished."""
        r.seq[r.n] = token
        r.n += 1
        r.models.append(model)
        self.out.put(("tok", (r.rid, token, model)))
        return r.num_generated >= self.max_new or token == self.eng.eos_token_id


class _Worker(threading.Thread):
    def __init__(self, name: str, sh: _Shared, side: ModelSide, inbox: queue.SimpleQueue) -> None:
        super().__init__(name=f"tokencache-{name}", daemon=True)
        self.sh = sh
        self.side = side
        self.inbox = inbox
        self.stopping = False

    def run(self) -> None:
        try:
            self.loop()
        except BaseException as e:
            self.sh.stop.set()
            self.sh.out.put(("error", e))

    def loop(self) -> None:
        raise NotImplementedError

    def handle(self, kind: str, payload: Any) -> None:
        raise NotImplementedError

    def drain(self, timeout: float | None) -> bool:
        """Handles queued messages, waiting up to timeout for the first; True if any came."""
        got = False
        while not self.stopping:
            try:
                kind, payload = (
                    self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
                )
            except queue.Empty:
                return got
            timeout = None
            got = True
            if kind == "stop":
                self.stopping = True
            else:
                self.handle(kind, payload)
        return got

    def make_room(self, batch: list[Request], held: list[Request], kind: int) -> bool:
        """Evict, then preempt the newest held request, until the batch fits; False when the
        worker must wait (its only request is the oldest, the other worker will free memory)."""
        while batch:
            need = tokens_needed(batch, kind)
            pool = self.side.pool
            if pool.available >= need:
                return True
            self.side.evict(need - pool.available)
            if pool.available >= need:
                return True
            victim = max(held, key=lambda q: q.admit_order)
            if self.sh.is_oldest(victim):
                if self.sh.only_active(victim) and not self.drain(None):
                    raise MemoryError(f"{self.side.name} KV pool too small for one request")
                return False
            held.remove(victim)
            if victim in batch:
                batch.remove(victim)
            self.preempt(victim)
            self.sh.count_preemption()
        return False

    def preempt(self, r: Request) -> None:
        """Drop r's KV (make_room already took it out of the held list)."""
        raise NotImplementedError


class SmallWorker(_Worker):
    def __init__(self, sh: _Shared, reqs: list[Request]) -> None:
        super().__init__("small", sh, sh.eng.small, sh.small_in)
        self.waiting: deque[Request] = deque(reqs)
        self.running: list[Request] = []
        self.n_active = 0  # admitted and not finished or preempted (max_running)
        self.admitted = 0
        self.admit_blocked = False

    def loop(self) -> None:
        sh = self.sh
        while not self.stopping and not sh.stop.is_set():
            self.drain(None)
            self.reap()
            self.admit()
            if self.running and self.step():
                continue
            sh.small_idle.set()  # nothing runnable: the large worker need not delay batching
            t0 = time.perf_counter()
            self.drain(_POLL_S)
            if self.n_active:
                sh.st.small_idle_s += time.perf_counter() - t0
            sh.small_idle.clear()

    def admit(self) -> None:
        sched = self.sh.eng.sched
        if self.admit_blocked and self.n_active:
            return
        self.admit_blocked = False
        page = self.side.tree.page_size
        while self.waiting and self.n_active < sched.max_running:
            r = self.waiting[0]
            if overlaps_prefill(r, self.running, SMALL, page):  # see batch.py
                self.sh.st.held_back += 1
                return
            self.waiting.popleft()
            r.kv = [CursorKV(self.sh.eng.small), CursorKV(self.sh.eng.large)]
            r.admit_order = self.admitted
            self.admitted += 1
            with self.sh.lock:
                self.sh.active.add(r.admit_order)
            self.n_active += 1
            self.running.append(r)

    def leave(self, r: Request, finished: bool) -> None:
        """r left for good (finished) or until re-admission (preempted): small KV released."""
        r.kv[SMALL].release(r.seq)
        self.n_active -= 1
        with self.sh.lock:
            self.sh.active.discard(r.admit_order)
        if finished:
            self.admit_blocked = False
            self.sh.out.put(("fin", r.rid))
        else:
            # No re-admission until a request finishes (two requests could preempt each other).
            self.admit_blocked = True
            self.waiting.appendleft(r)

    def reap(self) -> None:
        """Drops aborted requests held here: waiting ones (no KV) and running ones."""
        if any(r.aborted for r in self.waiting):
            for r in [r for r in self.waiting if r.aborted]:
                self.waiting.remove(r)
                self.sh.count_abort()
                self.sh.out.put(("fin", r.rid))
        if any(r.aborted for r in self.running):
            for r in [r for r in self.running if r.aborted]:
                self.running.remove(r)
                self.sh.count_abort()
                self.sh.large_in.put(("release", r.kv[LARGE]))
                self.leave(r, finished=True)

    def handle(self, kind: str, r: Any) -> None:
        if kind == "resume":
            self.running.append(r)
        elif kind == "finished":  # finished, or aborted while the large worker held it
            self.leave(r, finished=True)
        elif kind == "preempted":
            self.leave(r, finished=False)
        elif kind == "abort":
            pass  # woken up: reap() runs at the top of the loop
        else:
            raise ValueError(f"small worker: unknown message {kind}")

    def preempt(self, r: Request) -> None:
        self.sh.large_in.put(("release", r.kv[LARGE]))  # its large KV belongs to the other worker
        self.leave(r, finished=False)

    def step(self) -> bool:
        sh, st = self.sh, self.sh.st
        batch = list(self.running)
        attach_all(batch, SMALL)
        if not self.make_room(batch, self.running, SMALL):
            return False
        out, dt, ntok = run_forward(self.side, batch, SMALL)
        st.steps += 1
        st.small_tokens += ntok
        st.small_forward_s += dt
        tok, escalate = route_step(sh.eng.router, out, batch)
        keep: list[Request] = []
        for r, t, esc in zip(batch, tok.tolist(), escalate, strict=True):
            if esc:  # park: the small token is discarded and never fed
                r.parked_at = time.perf_counter()
                st.escalations += 1
                sh.large_in.put(("park", r))
            elif sh.commit(r, t, SMALL):
                sh.large_in.put(("release", r.kv[LARGE]))
                self.leave(r, finished=True)
            else:
                keep.append(r)
        self.running = keep
        return True


class LargeWorker(_Worker):
    def __init__(self, sh: _Shared) -> None:
        super().__init__("large", sh, sh.eng.large, sh.large_in)
        self.pending: list[Request] = []

    def handle(self, kind: str, payload: Any) -> None:
        if kind == "park":
            self.pending.append(payload)
        elif kind == "release":
            payload.release(None)
        elif kind == "abort":
            pass  # woken up: reap() runs at the top of the loop
        else:
            raise ValueError(f"large worker: unknown message {kind}")

    def reap(self) -> None:
        """Drops aborted parked requests: large KV released, handed back as finished."""
        if not any(r.aborted for r in self.pending):
            return
        keep: list[Request] = []
        for r in self.pending:
            if r.aborted:
                r.kv[LARGE].release(r.seq)
                self.sh.count_abort()
                self.sh.small_in.put(("finished", r))
            else:
                keep.append(r)
        self.pending = keep

    def preempt(self, r: Request) -> None:
        r.kv[LARGE].release(r.seq)
        self.sh.small_in.put(("preempted", r))

    def loop(self) -> None:
        sh, sched = self.sh, self.sh.eng.sched
        while not self.stopping and not sh.stop.is_set():
            self.drain(None)
            self.reap()
            wait = _POLL_S
            if self.pending:
                waited = time.perf_counter() - self.pending[0].parked_at
                if (
                    len(self.pending) >= sched.min_large_batch
                    or waited >= sched.max_wait_s
                    or sh.small_idle.is_set()
                ):
                    if self.step():
                        continue
                else:
                    wait = min(wait, max(sched.max_wait_s - waited, 1e-4))
            self.drain(wait)

    def step(self) -> bool:
        st = self.sh.st
        cap = self.sh.eng.sched.max_large_batch or len(self.pending)
        batch, _, held = take_catchup_batch(self.pending, cap, LARGE, self.side.tree.page_size)
        attach_all(batch, LARGE)
        if not self.make_room(batch, self.pending, LARGE):
            for r in held:  # not launched: they were not held behind a computed prefill
                r.held_catchup = False
            return False
        st.large_held_back += len(held)
        self.pending = [r for r in self.pending if r not in batch]
        out, dt, ntok = run_forward(self.side, batch, LARGE)
        st.large_forward_s += dt
        st.catchup_batch_sizes.append(len(batch))
        st.catchup_tokens.append(ntok)
        for r, t in zip(batch, out.logits.argmax(-1).tolist(), strict=True):
            if self.sh.commit(r, t, LARGE):
                r.kv[LARGE].release(r.seq)
                self.sh.small_in.put(("finished", r))
            else:
                self.sh.small_in.put(("resume", r))
        return True


def run_threaded(
    eng: RoutedEngine, reqs: list[Request], max_new: int, st: Stats
) -> Iterator[tuple[int, int, int]]:
    """Yields (request index, token, model) as the workers commit them; joins them at the end
    (also when the caller stops iterating early) and re-raises a worker's exception."""
    sh = _Shared(eng, st, max_new)
    small, large = SmallWorker(sh, reqs), LargeWorker(sh)
    with eng._abort_lock:  # aborts before this point are already flagged on the requests
        eng._wake_workers = sh.wake
    small.start()
    large.start()
    error: BaseException | None = None
    try:
        left = len(reqs)
        while left:
            try:
                kind, payload = sh.out.get(timeout=_POLL_S)
            except queue.Empty:
                if not (small.is_alive() and large.is_alive()):
                    kind, payload = sh.out.get(timeout=_POLL_S)  # the error it left, if any
                else:
                    continue
            if kind == "tok":
                st.tokens += 1
                yield payload
            elif kind == "fin":
                left -= 1
            else:
                error = payload
                break
    except queue.Empty:
        error = RuntimeError("a routing worker died without reporting")
    finally:
        # FIFO: each worker handles everything sent before its stop (pending releases included).
        if error is not None:
            sh.stop.set()
        for w in (small, large):  # small first: it is the last to message the large worker
            w.inbox.put(_STOP)
            w.join(_JOIN_S)
        hung = [w.name for w in (small, large) if w.is_alive()]
        while error is None:
            try:
                kind, payload = sh.out.get_nowait()
            except queue.Empty:
                break
            if kind == "error":
                error = payload
    if error is not None:
        raise error
    if hung:
        raise RuntimeError(f"routing workers did not stop: {hung}")
