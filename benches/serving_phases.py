"""Thread time per call of the scheduler's phases inside the serving benchmark, and what the
device waited for.

    python benches/serving_phases.py [python -m tokencache_routing bench arguments]

Runs `python -m tokencache_routing bench` with its arguments (default: the shared-prompt
workload at 8192, p = 0.1, tokencache only, stubbed device work) and each phase in PHASES
wrapped in two `time.thread_time()` reads, then prints calls, total and mean ms per phase.
Inclusive times; the wrappers add to what they time (read ratios between runs, not sums).
Then the engine clock's device idle (overlapped event loop, one device), by the launch it
waited for: a catch-up, the small step right after one, or any other small step.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))

from tokencache_routing.core import admission, batch_planning, forward_finishing
from tokencache_routing.core.state import LARGE
from tokencache_routing.drivers import events

DEFAULT = [
    *("--profile", "h200-roofline", "--contexts", "8192", "--rates", "0.1"),
    *("--dispatches", "tokencache", "--no-bounds", "--stub-device"),
]

# (label, owner, attribute): where the scheduler looks each one up at call time.
PHASES = (
    ("admit", admission.Admission, "admit"),
    ("schedule_small", batch_planning.BatchPlanning, "schedule_small"),
    ("finish_small", forward_finishing.ForwardFinishing, "finish_small"),
    ("schedule_large", batch_planning.BatchPlanning, "schedule_large"),
    ("  take_catchup_batch", batch_planning, "take_catchup_batch"),
    ("finish_large", forward_finishing.ForwardFinishing, "finish_large"),
)

# The device's idle on the engine clock, by the launch it waited for (timed_phases' spent).
IDLE = (
    "idle before a catch-up",
    "idle before the step after a catch-up",
    "idle before other steps",
)


@contextlib.contextmanager
def timed_phases() -> Iterator[dict[str, list[float]]]:
    """Within: each phase timed into spent[label] = [calls, seconds]; put back after."""
    spent: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    originals = [(owner, name, getattr(owner, name)) for _, owner, name in PHASES]
    for (label, _, _), (owner, name, f) in zip(PHASES, originals, strict=True):

        @functools.wraps(f)
        def timed(*args: Any, _f: Any = f, _label: str = label, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                entry = spent[_label]
                entry[0] += 1
                entry[1] += time.thread_time() - t0

        setattr(owner, name, timed)
    start_on_device = events.EventLoop._start_on_device
    after_catchup = False

    def waited(loop: events.EventLoop, launched: events.Launched, host_cost: float) -> None:
        """The device's wait for this launch (its start, after _start_on_device placed it,
        less when the device was free), by cause."""
        nonlocal after_catchup
        free = loop.dev_free
        start_on_device(loop, launched, host_cost)
        if launched.kind == LARGE:
            cause, after_catchup = IDLE[0], True
        else:
            cause, after_catchup = IDLE[1] if after_catchup else IDLE[2], False
        spent[cause][0] += 1
        spent[cause][1] += launched.end - launched.device_s - free

    events.EventLoop._start_on_device = waited  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        events.EventLoop._start_on_device = start_on_device  # type: ignore[method-assign]
        for owner, name, f in originals:
            setattr(owner, name, f)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    from tokencache_routing.tools.bench import main as bench

    with timed_phases() as spent:
        bench(list(argv) if argv else DEFAULT)
    print("| phase | calls | ms in all | ms a call |\n|---|---:|---:|---:|")
    for label, _, _ in PHASES:
        calls, s = spent[label]
        mean = f"{s / calls * 1e3:.3f}" if calls else "-"
        print(f"| {label} | {int(calls)} | {s * 1e3:.2f} | {mean} |")
    print("\n| device waited | launches | ms in all |\n|---|---:|---:|")
    for cause in IDLE:
        launches, s = spent[cause]
        print(f"| {cause} | {int(launches)} | {s * 1e3:.2f} |")
    return dict(spent)


if __name__ == "__main__":
    main(sys.argv[1:])
