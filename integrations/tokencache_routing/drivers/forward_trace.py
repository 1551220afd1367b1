"""The event loop's record of its forwards on the engine clock, and the clock's rules checked
over it.

With TRACE_ENV set (the routing tests set it for every test), an EventLoop keeps a
ForwardTrace: one ForwardSpan per forward it finished (its model, its shape, the device it ran
on, the requests it served, its start and end on the engine clock). Whenever no forward is in
flight the loop checks the spans recorded since the last check (ClockChecker); the rules:
- a forward ends no earlier than it starts;
- on each device forwards run one at a time, in the order they were launched: each starts no
  earlier than the one launched before it on that device ends (the device's times monotone);
- a forward starts no earlier than its inputs exist: each request's forwards follow one
  another, so a catch-up starts after the small step that parked its request ended, and a
  small step after the forward before it of each of its requests (a catch-up's included).
Off by default: a serving engine's record would grow without end."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from ..core.batch import PreparedForward
from ..core.state import SMALL

TRACE_ENV = "TOKENCACHE_TRACE_FORWARDS"


def tracing() -> bool:
    """Whether a new event loop records and checks its forwards (TRACE_ENV set, not "0")."""
    return os.environ.get(TRACE_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class ForwardSpan:
    """One forward on the engine clock. seq: its launch order in the loop; model: "small" or
    "large"; kind: "decode" (one new token a row), "prefill" (a small forward with prompt
    tokens) or "catch-up" (every large forward); device: 0, or 1 for the large model on two
    devices; rids: the requests it served (rows dropped from it left out)."""

    seq: int
    model: str
    kind: str
    device: int
    rids: tuple[int, ...]
    start: float
    end: float

    @property
    def row(self) -> tuple[str, str, tuple[int, ...], float, float]:
        """(model, kind, rids, start, end): what a test writes out by hand."""
        return self.model, self.kind, self.rids, self.start, self.end

    def __str__(self) -> str:
        return (
            f"forward #{self.seq} ({self.model} {self.kind} of requests {list(self.rids)} on "
            f"device {self.device}, {self.start}..{self.end})"
        )


def span_of(
    seq: int, kind: int, prep: PreparedForward, two_devices: bool, start: float, end: float
) -> ForwardSpan:
    """The span of a finished forward of model `kind` (SMALL or LARGE)."""
    rids = tuple(r.rid for i, r in enumerate(prep.batch) if i not in prep.dropped)
    if kind == SMALL:
        shape = "decode" if prep.num_tokens == len(prep.batch) else "prefill"
        return ForwardSpan(seq, "small", shape, 0, rids, start, end)
    return ForwardSpan(seq, "large", "catch-up", int(two_devices), rids, start, end)


class ClockChecker:
    """Checks spans against the clock's rules (module docstring), a batch at a time: every
    forward launched before a batch's last one is in it or in an earlier batch."""

    def __init__(self) -> None:
        self.device_last: dict[int, ForwardSpan] = {}
        self.request_last: dict[int, ForwardSpan] = {}

    def check(self, spans: Iterable[ForwardSpan]) -> None:
        """Raises AssertionError naming the first forward that breaks a rule."""
        for span in sorted(spans, key=lambda s: s.seq):
            if span.end < span.start:
                raise AssertionError(f"{span} ends before it starts")
            for rid in span.rids:
                prev = self.request_last.get(rid)
                if prev is not None and span.start < prev.end:
                    parked = prev.model == "small" and span.model == "large"
                    what = ", the step that parked it," if parked else ""
                    raise AssertionError(f"{span} starts before request {rid}'s {prev}{what} ends")
                self.request_last[rid] = span
            before = self.device_last.get(span.device)
            if before is not None and span.start < before.end:
                raise AssertionError(f"{span} starts before {before}, on its device, ends")
            self.device_last[span.device] = span


def check_forwards(spans: Iterable[ForwardSpan]) -> None:
    """All of a run's spans against the clock's rules (ClockChecker)."""
    ClockChecker().check(spans)


class ForwardTrace:
    """An event loop's spans (all of them, in the order its forwards finished) and the checker
    it feeds the new ones to whenever nothing is in flight."""

    def __init__(self) -> None:
        self.spans: list[ForwardSpan] = []
        self.checker = ClockChecker()
        self.checked = 0

    def add(self, span: ForwardSpan) -> None:
        self.spans.append(span)

    def check(self) -> None:
        new = self.spans[self.checked :]
        self.checked = len(self.spans)
        self.checker.check(new)
