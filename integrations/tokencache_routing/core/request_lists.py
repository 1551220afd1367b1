"""Where the scheduler keeps its requests (waiting, running on the small model, parked for a
catch-up, in flight, inside a forward) and how a request leaves them: finished, failed or
aborted, its KV in both models released on every way out.

The base of the Scheduler's parts (core/scheduler.py): it holds the state every part reads."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from .kv import KVHandle, ModelSide
from .launch_policy import Price
from .routers import Router
from .scheduler_config import SchedulerConfig
from .state import SMALL, Request, Stats


class RequestLists:
    """The scheduler's state. Drivers call it while holding `lock`; a request inside a
    running forward is `busy` and nobody else touches it."""

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

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked or self.inflight or self.busy)

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def take_touched(self) -> list[Request]:
        out, self.touched = self.touched, []
        return out

    # ------------------------------------------------------------ leaving

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
