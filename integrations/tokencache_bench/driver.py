"""What every cache implementation offers the replay loop."""

from __future__ import annotations

from abc import ABC, abstractmethod

from tokencache_bench.trace import HandOff, Trace


class Driver(ABC):
    """One cache implementation replaying one trace.

    `admit` (untimed) caches a request's prompt; `handoff` performs one hand-off and returns the
    nanoseconds of each operation named in `ops`. Batched drivers implement `step` instead: one
    call for all hand-offs of a decode step, returning its nanoseconds.
    """

    name: str = ""
    ops: tuple[str, ...] = ()
    batched: bool = False
    # Python trees allocate on the Python heap, which tracemalloc can see.
    python_heap: bool = False

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    @abstractmethod
    def admit(self, request: int) -> None: ...

    def handoff(self, h: HandOff) -> tuple[int, ...]:
        raise NotImplementedError

    def step(self, handoffs: list[HandOff]) -> int:
        raise NotImplementedError

    @abstractmethod
    def cached_tokens(self) -> int:
        """Tokens the tree holds now; must equal trace.total_tokens() after the replay."""

    def close(self) -> None:  # noqa: B027 (optional hook; most drivers hold nothing)
        """Release what the driver holds (untimed)."""
