"""The interfaces between the engine and its drivers (typed Protocols): Driver, what the engine
asks of the threads that run its scheduler (drivers/events.py's EventLoopThread,
drivers/threaded.py's ThreadedDriver), and DriverEngine, the engine as a driver sees it
(RoutedEngine implements it; docs/ARCHITECTURE.md draws them). Apart from state.py, which the
scheduler imports, since DriverEngine hands out the Scheduler."""

from __future__ import annotations

from typing import Protocol

from .kv import ModelSide
from .scheduler import Scheduler
from .state import Request


class Driver(Protocol):
    """What the engine asks of a driver: the threads that run its scheduler
    (drivers/events.py's EventLoopThread after start(), drivers/threaded.py's ThreadedDriver
    with mode="threaded"). A driver calls only DriverEngine on the engine."""

    def start(self) -> None: ...

    def alive(self) -> bool: ...

    def wake(self) -> None:
        """New work, an abort or shutdown: look again now."""
        ...

    def join(self, timeout: float) -> None: ...


class DriverEngine(Protocol):
    """The driver interface: the engine as a driver sees it (RoutedEngine implements it). A
    driver takes `sched.lock` to schedule and commit, runs forwards outside it, calls notify
    outside it, and exits when idle and driver_should_exit() (or closed) says so."""

    @property
    def sched(self) -> Scheduler: ...

    @property
    def sides(self) -> tuple[ModelSide, ModelSide]: ...

    @property
    def overlap(self) -> bool:
        """Overlapped scheduling: the next small step is launched before the last one is
        finished on the host."""
        ...

    @property
    def closed(self) -> bool: ...

    def intake(self) -> None:
        """Under the scheduler lock: submitted requests enter the scheduler."""
        ...

    def has_submissions(self) -> bool: ...

    def notify(self, reqs: list[Request]) -> None:
        """Outside the scheduler lock: runs the listeners of requests with news."""
        ...

    def now(self) -> float:
        """The engine clock, stamped on delivered tokens."""
        ...

    def driver_should_exit(self) -> bool:
        """An idle driver asks (outside the scheduler lock): True retires it."""
        ...

    def iterate_exclusive(self) -> bool:
        """The event loop's driver: one iteration, no inline driver beside it; False when
        there was nothing to do."""
        ...

    def drain_exclusive(self) -> None:
        """The event loop's driver, exiting: the aborts left applied, a pending step finished."""
        ...
