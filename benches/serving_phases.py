"""Thread time per call of the scheduler's phases inside the serving benchmark.

    python benches/serving_phases.py [tokencache_routing.bench arguments]

Runs `python -m tokencache_routing.bench` with its arguments (default: the shared-prompt
workload at 8192, p = 0.1, tokencache only, stubbed device work) and each phase in PHASES
wrapped in two `time.thread_time()` reads, then prints calls, total and mean ms per phase.
Inclusive times; the wrappers add to what they time (read ratios between runs, not sums).
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

from tokencache_routing.core import scheduler

DEFAULT = [
    *("--profile", "h200-roofline", "--contexts", "8192", "--rates", "0.1"),
    *("--dispatches", "tokencache", "--no-bounds", "--stub-device"),
]

# (label, owner, attribute): where the scheduler looks each one up at call time.
PHASES = (
    ("admit", scheduler.Scheduler, "admit"),
    ("schedule_small", scheduler.Scheduler, "schedule_small"),
    ("finish_small", scheduler.Scheduler, "finish_small"),
    ("schedule_large", scheduler.Scheduler, "schedule_large"),
    ("  take_catchup_batch", scheduler, "take_catchup_batch"),
    ("finish_large", scheduler.Scheduler, "finish_large"),
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
    try:
        yield spent
    finally:
        for owner, name, f in originals:
            setattr(owner, name, f)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    from tokencache_routing.bench import main as bench

    with timed_phases() as spent:
        bench(list(argv) if argv else DEFAULT)
    print("| phase | calls | ms in all | ms a call |\n|---|---:|---:|---:|")
    for label, _, _ in PHASES:
        calls, s = spent[label]
        mean = f"{s / calls * 1e3:.3f}" if calls else "-"
        print(f"| {label} | {int(calls)} | {s * 1e3:.2f} | {mean} |")
    return dict(spent)


if __name__ == "__main__":
    main(sys.argv[1:])
