"""Threaded driver: one worker thread per model over the one scheduler, no global barrier.

Each worker takes the scheduler's lock to schedule a batch (admission, make-room, allocation)
and to commit its results, and runs its forward outside the lock, so the two models overlap:
tokencache releases the GIL in bulk calls and torch releases it in its ops. A request inside a
forward is busy: the other worker neither preempts nor touches it. The large worker launches a
catch-up when SchedulerConfig.launch_large says so: with the models on one device, a batch big
enough, the oldest waited max_wait_s, holes in the small batch, or nothing else to run
(launch="cost": once the holes' accumulated cost reaches a catch-up's fixed cost, on the
engine clock's prices, or measured forward times under the wall clock: MeasuredPrices); with
each model on its own device, whenever anything is parked. A request inside a catch-up holds no
place in the small batch (admission refills it); back, it joins the small model's next step,
longest-waiting first, and the batch cap makes the most recently stepped requests wait instead.

Memory: make-room evicts, then preempts the newest idle request; when only the other worker's
busy requests could free memory, the worker waits for that forward to end.

The driver sees the engine through driver_api.DriverEngine only (the driver interface), and the
engine sees it as a driver_api.Driver (start, alive, wake, join).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..core.admission import WaitForMemory
from ..core.batch import PreparedForward
from ..core.driver_api import DriverEngine
from ..core.kv import forward_paths
from ..core.state import LARGE, SMALL

_POLL_S = 0.05  # a waiting worker looks again at least this often


class ThreadedDriver:
    def __init__(self, eng: DriverEngine) -> None:
        self.eng = eng
        self.sched = eng.sched
        self.cv = threading.Condition(self.sched.lock)
        self.stop = False
        # One GPU: the large model's forwards go on a second CUDA stream so the two models'
        # kernels can overlap (on two devices each has its own default stream anyway).
        self.streams: list[Any] = [None, None]
        large_dev = eng.sides[LARGE].model.device
        # The real placement, not the event loop's clock topology.
        self.own_device = large_dev != eng.sides[SMALL].model.device
        if large_dev.type == "cuda" and not self.own_device:
            self.streams[1] = torch.cuda.Stream(device=large_dev)  # type: ignore[no-untyped-call]
        self.pending: PreparedForward | None = None  # the small step launched, not finished
        self.threads = [
            threading.Thread(target=self._guard, args=(self._small,), name="tokencache-small"),
            threading.Thread(target=self._guard, args=(self._large,), name="tokencache-large"),
        ]
        for t in self.threads:
            t.daemon = True

    # ------------------------------------------------------------ driver interface

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def join(self, timeout: float) -> None:
        deadline = time.perf_counter() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.perf_counter()))

    # ------------------------------------------------------------ workers

    def _guard(self, loop: object) -> None:
        """A bug in a worker fails every request (released) instead of hanging callers."""
        try:
            loop()  # type: ignore[operator]
        except BaseException as e:
            with self.cv:
                self.stop = True
                s = self.sched
                pending, self.pending = self.pending, None
                if pending is not None:  # its new slots back; its requests fail below
                    pending.discard()
                s.fail(s.active() + list(s.waiting), e)
                touched = s.take_touched()
                self.cv.notify_all()
            self.eng.notify(touched)

    def _notify(self) -> None:
        """Under the lock: hand the news to listeners after releasing it."""
        touched = self.sched.take_touched()
        self.cv.notify_all()
        self.cv.release()
        try:
            self.eng.notify(touched)
        finally:
            self.cv.acquire()

    def _run(self, prep: PreparedForward, kind: int) -> float | None:
        """Launches the forward (its tokens drawn on the device) outside the lock; returns its
        measured time, or None when it raised (its requests failed and freed their KV)."""
        self.cv.release()
        try:
            stream = self.streams[kind]
            router = self.sched.router if kind == 0 else None  # small steps route at launch
            if stream is None:
                return prep.launch(router)
            with torch.cuda.stream(stream):
                dt = prep.launch(router)
            stream.synchronize()
            return dt
        except BaseException as e:
            error = e
        finally:
            self.cv.acquire()
        self.sched.abandon(prep, error)
        if not isinstance(error, Exception):
            raise error
        return None

    def _small(self) -> None:
        """Schedule, launch, finish. With overlap the next step is scheduled and launched
        before the previous one is finished (`pending`): on CUDA the host prepares it while
        the device still runs the previous step."""
        eng, s = self.eng, self.sched
        with self.cv:
            while not self.stop:
                eng.intake()
                s.apply_aborts()
                s.admit()
                pending = self.pending
                try:
                    prep = s.schedule_small(pending if eng.overlap else None)
                except WaitForMemory:
                    prep = None
                if prep is None:
                    if pending is not None:  # nothing new: finish the pending step
                        self._finish_pending()
                        continue
                    self._notify()
                    idle = not s.has_work() and not eng.has_submissions()
                    if idle and (eng.closed or self._exit_when_idle()):
                        break
                    self.cv.wait(_POLL_S)
                    continue
                dt = self._run(prep, 0)
                if dt is not None:
                    s.observe_forward(SMALL, dt)
                # The new step is pending before the old one is finished: whatever raises
                # there, _guard still finds it.
                self.pending = prep if dt is not None else None
                if pending is not None:
                    self._finish(pending)
                    if not any(prep.live()):  # all its rows dropped: finish it now
                        self._finish_pending()
                if dt is not None:
                    s.stats.small_forward_s += dt
                    if not eng.overlap:
                        self._finish_pending()
                self._publish_stats()
                self._notify()
            if self.pending is not None:
                self._finish_pending()
            self.stop = True
            self.cv.notify_all()

    def _finish_pending(self) -> None:
        prep, self.pending = self.pending, None
        if prep is not None:  # (None: discarded meanwhile by a failing worker, _guard)
            self._finish(prep)

    def _finish(self, prep: PreparedForward) -> None:
        """Finish a launched small step (a sync on its tokens) and hand out its results."""
        eng, s = self.eng, self.sched
        assert prep.out is not None
        now = eng.now()
        for r in s.finish_small(prep, prep.out, now):
            r.parked_at = now
        # Refill parked places before the large worker looks for holes.
        eng.intake()
        s.admit()

    def _exit_when_idle(self) -> bool:
        self.cv.release()
        try:
            return self.eng.driver_should_exit()
        finally:
            self.cv.acquire()

    def _large(self) -> None:
        eng, s = self.eng, self.sched
        cfg = s.cfg
        with self.cv:
            while not self.stop:
                s.apply_aborts()
                if not s.parked:
                    self._notify()
                    self.cv.wait(_POLL_S)
                    continue
                waited = eng.now() - s.parked[0].parked_at
                waited_out = cfg.waited_out(waited, cfg.max_wait_s)
                if not s.launch_due(waited_out, own_device=self.own_device):
                    # launch="cost" without a cap: the small worker's steps wake it (_notify)
                    left = cfg.max_wait_s - waited if cfg.max_wait_s > 0 else _POLL_S
                    self.cv.wait(min(_POLL_S, max(left, 1e-4)))
                    continue
                try:
                    prep = s.schedule_large()
                except WaitForMemory:
                    self.cv.wait(_POLL_S)
                    continue
                if prep is None:
                    self._notify()
                    continue
                dt = self._run(prep, 1)
                if dt is not None:
                    s.observe_forward(LARGE, dt)
                    assert prep.out is not None
                    s.stats.large_forward_s += dt
                    s.running += s.finish_large(prep, prep.out, eng.now())
                self._publish_stats()
                self._notify()

    def _publish_stats(self) -> None:
        st = self.sched.stats
        st.bookkeeping_s = sum(side.bookkeeping_s for side in self.eng.sides)
        st.forward_paths = forward_paths(self.eng.sides)
        st.modeled_s = self.eng.now()
