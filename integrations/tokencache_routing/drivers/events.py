"""The event-loop driver: the deterministic loop RoutedEngine runs inline (in the caller's
thread) or in a background thread after start() (EventLoopThread), the overlapped pipeline
(overlap=True), and the engine clock it keeps with its clocks plugged in: the small model's
(t_small: also the host's with overlap), the large model's (t_large), a catch-up's end
(done_at) and the device queue (dev_free). A forward's device cost comes from the engine's
forward_cost (the GPU clock, sim/clock.py, or the step / measured clocks); what counts of a
step's host time is host_charge (charge, host_cost).

EventLoop sees the engine through EventEngine only (the driver interface plus its clock
options); the engine owns one and calls iterate_locked() under the scheduler lock."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Protocol

from ..core.admission import WaitForMemory
from ..core.batch import PreparedForward
from ..core.driver_api import DriverEngine
from ..core.kv import forward_paths
from ..core.state import LARGE, SMALL, Request
from .forward_trace import ForwardTrace, span_of, tracing


class EventEngine(DriverEngine, Protocol):
    """The engine as the event loop sees it: the driver interface, the clock options it was
    built with, the modelled runner's host work and the price of one forward
    (RoutedEngine.runner_host_work, forward_cost)."""

    @property
    def topology(self) -> str: ...

    @property
    def clock(self) -> str: ...

    @property
    def host_charge(self) -> str: ...

    def runner_host_work(self, prep: PreparedForward) -> None: ...

    def forward_cost(self, kind: int, prep: PreparedForward, measured_s: float) -> float: ...


class EventLoop:
    """One engine's event loop: its clocks and the step launched and not finished yet."""

    def __init__(self, eng: EventEngine) -> None:
        self.eng = eng
        self.sched = eng.sched
        self.sides = eng.sides
        # engine clocks: the small model's, the large model's, a catch-up's end
        self.t_small = self.t_large = self.done_at = 0.0
        # Overlap: the small step launched and not finished yet, and when the device's queue
        # is done on the engine clock (the host clock is t_small).
        self.pending: Launched | None = None
        self.dev_free = 0.0
        self.launches = 0  # forwards launched so far: a forward's launch order (Launched.seq)
        # Each finished forward's span on the clock, checked whenever none is in flight
        # (forward_trace.py); kept only when asked (TRACE_ENV: the tests).
        self.trace: ForwardTrace | None = ForwardTrace() if tracing() else None

    def now(self) -> float:
        """The engine clock: the later of the two models' clocks."""
        return max(self.t_small, self.t_large)

    def iterate_locked(self) -> bool:
        """One iteration under the scheduler lock (RoutedEngine.iterate): intake, aborts,
        admission, then a step as the dispatch, overlap and topology say; False when there was
        nothing to do."""
        s = self.sched
        with self._host_work():
            self.eng.intake()
            s.apply_aborts()
            self._rejoin()
            # A request is submitted at now(), the later of the two models' clocks (two
            # devices: the large one may be ahead); the small model starts none before it.
            s.admit(not_after=self.t_small)
            if s.waiting and not s.running and not s.busy:
                # Nothing to step until the next request arrives: the small model waits.
                self._nothing_to_run_until(s.waiting[0].submitted_at)
                self._rejoin()
                s.admit(not_after=self.t_small)
        if not s.has_work():
            if self.pending is None:
                if self.trace is not None:
                    self.trace.check()
                return False
            self.land_pending()  # only rows dropped from it are left: their slots go back
            return True
        if s.barrier:
            self._barrier_iteration()
        elif self.eng.overlap:
            self._pipelined_iteration()
        elif self.eng.topology == "two-devices":
            self._overlapped_iteration()
        else:
            self._serial_iteration()
        s.stats.bookkeeping_s = sum(side.bookkeeping_s for side in self.sides)
        s.stats.forward_paths = forward_paths(self.sides)
        s.stats.modeled_s = self.eng.now()
        if self.trace is not None and self.pending is None:
            self.trace.check()
        return True

    def _host_work(self) -> HostWork:
        """Host work outside a forward's launch and finish (intake, aborts, admission), timed
        by `with self._host_work():` (HostWork)."""
        return HostWork(self)

    def _charge_host_work(self, host: float, tree_s: float) -> None:
        """The small model's host clock pays host work as it pays a step's, so the GPU waits
        for it where nothing hides it (Stats.small_host_s counts it). Charged only while there
        is work: an idle engine's clock does not creep."""
        if self.sched.has_work() or self.pending is not None:
            st = self.sched.stats
            st.host_s += host
            st.small_host_s += host
            charge = self._host_cost(host, tree_s)
            self.t_small += charge
            if not self.eng.overlap:  # serially the device waits for it (with overlap,
                st.device_idle_s += charge  # _start_on_device finds what it waits for)

    def _nothing_to_run_until(self, t: float) -> None:
        """The small model has no work before engine time t (the next arrival, a catch-up's
        return): its clock moves there, and so does its device queue, so that this wait is
        not counted as the device waiting for the host (Stats.device_idle_s)."""
        self.t_small = max(self.t_small, t)
        self.dev_free = max(self.dev_free, t)  # host work already past t is still waited for

    def _rejoin(self) -> None:
        """Two devices: a catch-up's requests rejoin once the small clock reaches its end."""
        s = self.sched
        if s.inflight and self.done_at <= self.t_small:
            s.running += s.inflight
            s.inflight = []

    def _barrier_iteration(self) -> None:
        s, st = self.sched, self.sched.stats
        if s.parked:  # synchronous barrier: the small model waits for every catch-up
            d, back = self._run_large(self.t_small)
            st.small_idle_s += d
            self.t_small += d
            s.running += back
        if s.running:
            self.t_small += self._run_small(self.t_small)
        self.t_large = self.t_small

    def _serial_iteration(self) -> None:
        """One device: a catch-up runs between two small steps; its requests rejoin the next."""
        s, st = self.sched, self.sched.stats
        if self._large_due():
            d, back = self._run_large(self.t_small)
            if s.running:
                st.small_idle_s += d
            self.t_small += d
            s.running += back
        if s.running:
            self.t_small += self._run_small(self.t_small)
        self.t_large = self.t_small

    def _overlapped_iteration(self) -> None:
        """Two devices: a catch-up computed now rejoins when the large clock says it ended;
        meanwhile the small model keeps stepping the others."""
        s, st = self.sched, self.sched.stats
        if not s.inflight and self._large_due():
            start = max(self.t_large, self.t_small)
            d, back = self._run_large(start)
            self.done_at = self.t_large = start + d
            s.inflight = back
        if s.running:
            self.t_small += self._run_small(self.t_small)
        elif s.inflight:  # nothing else to run: idle until the catch-up is back
            st.small_idle_s += self.done_at - self.t_small
            self.t_small = self.done_at

    def _large_due(self) -> bool:
        s = self.sched
        waited_out = bool(s.parked) and s.cfg.waited_out(
            s.stats.steps - s.parked[0].parked_step, s.cfg.max_wait_steps
        )
        return s.launch_due(waited_out, own_device=self.eng.topology == "two-devices")

    def _tree_s(self) -> float:
        small, large = self.sides  # several times a step: no generator
        return small.bookkeeping_s + large.bookkeeping_s

    def _charge(self, device_s: float, host_s: float, tree_s: float) -> float:
        """A step's cost on the engine clock from its device cost and its measured host time
        (host_charge), for the serial path (overlap=False; the overlapped event loop keeps a
        host clock and a device queue instead, _start_on_device): "serial", the GPU waits for
        all of the host's work (scheduling, the runner's preparation, sampling, the router,
        commits, the trees); "overlap", max(host, device): a projection of an overlapped host
        path, kept to compare; "trees", only the tree calls (an engine that charged no other
        host time, kept to compare). The step clock charges no host time (a pure function of
        the schedule)."""
        if self.eng.clock == "steps":
            return device_s
        if self.eng.host_charge == "serial":
            return device_s + host_s
        if self.eng.host_charge == "overlap":
            return max(device_s, host_s)
        return device_s + tree_s

    def _run_small(self, t: float) -> float:
        cost, parked = self._run(SMALL, t)
        for r in parked:
            r.parked_step = self.sched.stats.steps
        return cost

    def _run_large(self, t: float) -> tuple[float, list[Request]]:
        return self._run(LARGE, t)

    def _run(self, kind: int, t: float) -> tuple[float, list[Request]]:
        """Schedule, run and commit one forward of a model starting at clock time t, the host
        waiting for the device in between (no overlap); returns its cost on the engine clock
        and the requests finish_* hands back (parked after a small step, going on after a
        catch-up)."""
        try:
            launched = self._launch(kind)
        except WaitForMemory:  # nothing is busy in the event loop
            raise RuntimeError("event loop: memory held by a busy request") from None
        if launched is None:
            return 0.0, []
        # Tokens are delivered at the step's end: its host time so far and its device work.
        back, host, tree = self._land(launched, t + self._charge(*launched.costs))
        cost = self._charge(launched.device_s, host, tree)
        self._record(launched, t, t + cost)
        if kind == SMALL:  # the GPU waits for what the clock charges beyond its work
            self.sched.stats.device_idle_s += cost - launched.device_s
        return cost, back

    def _launch(self, kind: int, after: PreparedForward | None = None) -> Launched | None:
        """Schedule one forward of a model and launch it (its tokens drawn on the device);
        None when there is nothing to run. Raises WaitForMemory from the scheduler."""
        s = self.sched
        timer = self.sides[kind].timer
        h0, tree0 = timer(), self._tree_s()
        prep = s.schedule_small(after) if kind == SMALL else s.schedule_large()
        if prep is None:
            return None
        try:
            dt = prep.launch(s.router if kind == SMALL else None)
        except BaseException as e:
            s.abandon(prep, e)
            if not isinstance(e, Exception):
                raise
            return None
        s.observe_forward(kind, dt)  # launch="cost" on measured prices learns from it
        self.eng.runner_host_work(prep)  # the modelled runner's grouping is host work
        host = timer() - h0 - prep.execute_host_s
        device = self.eng.forward_cost(kind, prep, dt)  # the clock's pricing is not
        self.launches += 1
        return Launched(kind, prep, dt, device, host, self._tree_s() - tree0, self.launches)

    def _record(self, launched: Launched, start: float, end: float) -> None:
        """A finished forward's span on the clock, when the loop keeps a trace."""
        if self.trace is not None:
            two = self.eng.topology == "two-devices"
            self.trace.add(span_of(launched.seq, launched.kind, launched.prep, two, start, end))

    def _land(self, launched: Launched, now: float) -> tuple[list[Request], float, float]:
        """Finish a launched forward on the host at engine time `now` (tokens committed and
        delivered); returns what finish_* hands back, and the forward's host and tree time in
        all (launch and finish)."""
        s, kind, prep = self.sched, launched.kind, launched.prep
        timer = self.sides[kind].timer
        h0, tree0 = timer(), self._tree_s()
        assert prep.out is not None
        finish = s.finish_small if kind == SMALL else s.finish_large
        back = finish(prep, prep.out, now)
        host = launched.host_s + timer() - h0
        tree = launched.tree_s + self._tree_s() - tree0
        st = s.stats
        st.host_s += host
        if kind == SMALL:
            st.small_forward_s += launched.forward_s
            st.small_host_s += host
            st.small_device_s += launched.device_s
            for r in back:
                r.parked_step = st.steps
        else:
            st.large_forward_s += launched.forward_s
        return back, host, tree

    # ------------------------------------------------------------ overlapped event loop

    def _host_cost(self, host_s: float, tree_s: float) -> float:
        """Host time on the engine clock: what host_charge counts of it ("trees": the tree
        calls only); none on the step clock."""
        if self.eng.clock == "steps":
            return 0.0
        return tree_s if self.eng.host_charge == "trees" else host_s

    def _start_on_device(self, launched: Launched, host_cost: float) -> None:
        """The host clock advances by the launch's host work, then the forward queues on the
        device: it starts when both the host launched it and the device is free."""
        self.t_small += host_cost
        start = max(self.dev_free, self.t_small)
        if launched.kind == SMALL:
            self.sched.stats.device_idle_s += start - self.dev_free
        self.dev_free = start + launched.device_s
        launched.start, launched.end = start, self.dev_free

    def _launch_timed(self, kind: int, after: PreparedForward | None = None) -> Launched | None:
        launched = self._launch(kind, after)
        if launched is not None:
            self._start_on_device(launched, self._host_cost(launched.host_s, launched.tree_s))
        return launched

    def _land_timed(self, launched: Launched) -> list[Request]:
        """The host waits for the forward's end on the device, then finishes it."""
        self.t_small = max(self.t_small, launched.end)
        h0, tree0 = launched.host_s, launched.tree_s
        back, host, tree = self._land(launched, self.t_small)
        self._record(launched, launched.start, launched.end)
        self.t_small += self._host_cost(host - h0, tree - tree0)
        return back

    def land_pending(self) -> None:
        """Finish the pending small step, if any (overlap)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._land_timed(pending)

    def _pipelined_iteration(self) -> None:
        """Overlap: the next small step is scheduled, prepared and launched while the device
        still runs the previous one, whose tokens the host then finishes (SGLang's overlap
        scheduler, vLLM's async scheduling). Its requests continue in the new step with their
        drawn token (resolved on the device); one the router parks or that ends is dropped
        from it. On one device a due catch-up is launched right after (queued behind the new
        step) and finished at once, after the new step that ends before it, so its requests
        join the next step (a request the router parks misses the one step it was dropped
        from); the device then waits for the next step's preparation, the one host time a
        catch-up does not hide. On two devices a catch-up runs beside the small steps, its
        requests rejoining at its end. The host waits for the device only to finish a step;
        the clock charges what the device waits for the host (Stats.device_idle_s)."""
        s, st = self.sched, self.sched.stats
        if self.eng.topology == "two-devices" and not s.inflight and self._large_due():
            catchup = self._launch_large_timed()
            if catchup is not None:  # finished at once; rejoins at its end (_rejoin)
                self._finish_catchup(catchup)
        # The pending step stays in self.pending until it is finished: whatever raises
        # meanwhile, the next iteration or the engine's abort flush (RoutedEngine.shutdown,
        # inline waits) finishes it (nothing stays busy or allocated).
        pending = self.pending
        try:
            nxt = self._launch_timed(SMALL, pending.prep if pending is not None else None)
        except WaitForMemory:  # memory held by busy requests: finish what holds it first
            if pending is None:
                raise RuntimeError("event loop: memory held by a busy request") from None
            self.land_pending()
            pending = nxt = None
            with contextlib.suppress(WaitForMemory):
                nxt = self._launch_timed(SMALL)
        self.pending = nxt
        if pending is not None:
            self._land_timed(pending)
        if nxt is not None and not any(nxt.prep.live()):  # all rows dropped: nothing to wait for
            self.land_pending()
        if self.eng.topology == "one-device":
            # Places the landed step freed are refilled before holes can launch a catch-up.
            with self._host_work():
                self.eng.intake()
                s.admit(not_after=self.t_small)
            if self._large_due():
                catchup = self._launch_large_timed()
                if catchup is not None:
                    self._finish_catchup(catchup)
            self.t_large = self.t_small
            return
        self.t_large = max(self.t_large, self.t_small)
        if nxt is None and not s.running and s.inflight:  # idle until the catch-up is back
            st.small_idle_s += max(0.0, self.done_at - self.t_small)
            self._nothing_to_run_until(self.done_at)

    def _launch_large_timed(self) -> Launched | None:
        """A catch-up on the large model: on one device it queues behind the small steps;
        on two it starts when the large device is free."""
        if self.eng.topology == "one-device":
            try:
                return self._launch_timed(LARGE)
            except WaitForMemory:
                return None
        try:
            launched = self._launch(LARGE)
        except WaitForMemory:
            return None
        if launched is not None:
            self.t_small += self._host_cost(launched.host_s, launched.tree_s)
            start = max(self.t_large, self.t_small)
            launched.start = start
            launched.end = self.t_large = start + launched.device_s
        return launched

    def _finish_catchup(self, catchup: Launched) -> None:
        s, st = self.sched, self.sched.stats
        if self.eng.topology == "one-device":
            # The step queued ahead of it ends first: its tokens are delivered at its end, not
            # held until the catch-up's.
            self.land_pending()
            if s.running or s.busy:
                st.small_idle_s += catchup.device_s
            s.running += self._land_timed(catchup)
            return
        # Two devices: finished on the host now, its requests rejoin once the small clock
        # reaches the catch-up's end (_rejoin).
        h0, tree0 = catchup.host_s, catchup.tree_s
        back, host, tree = self._land(catchup, catchup.end)
        self._record(catchup, catchup.start, catchup.end)
        self.t_small += self._host_cost(host - h0, tree - tree0)
        self.done_at = catchup.end
        s.inflight = back


@dataclass
class Launched:
    """A forward launched by the event loop and not finished yet: its device time measured
    (forward_s) and on the engine clock (device_s), its host and tree time so far, its launch
    order (seq), and (with overlap) when it starts and ends on the engine clock."""

    kind: int
    prep: PreparedForward
    forward_s: float
    device_s: float
    host_s: float
    tree_s: float
    seq: int = 0
    start: float = 0.0
    end: float = 0.0

    @property
    def costs(self) -> tuple[float, float, float]:
        return self.device_s, self.host_s, self.tree_s


class EventLoopThread:
    """start(): the event loop in a background thread, sleeping while there is no work."""

    def __init__(self, eng: DriverEngine) -> None:
        self.eng = eng
        self.event = threading.Event()
        self.thread = threading.Thread(target=self.run, name="tokencache-events", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def wake(self) -> None:
        self.event.set()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def run(self) -> None:
        eng = self.eng
        while True:
            self.event.clear()
            if eng.iterate_exclusive():
                continue
            if eng.closed or eng.driver_should_exit():
                eng.drain_exclusive()
                return
            self.event.wait(0.5)


class HostWork:
    """EventLoop._host_work's context: the small model's host timer and the trees' time
    around intake, aborts and admission, charged on exit (EventLoop._charge_host_work). A
    class, not a generator-based context manager: it runs twice a step, and a generator's
    protocol costs about twice the Python calls."""

    __slots__ = ("h0", "loop", "tree0")

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop

    def __enter__(self) -> None:
        loop = self.loop
        self.h0, self.tree0 = loop.sides[SMALL].timer(), loop._tree_s()

    def __exit__(self, *exc: object) -> None:
        loop = self.loop
        host = loop.sides[SMALL].timer() - self.h0
        loop._charge_host_work(host, loop._tree_s() - self.tree0)
