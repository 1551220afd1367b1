"""The GPU clock checked against a GPU run's rows (the method: sim/clock_check.py).

    python -m tokencache_routing clock-check [RESULTS_DIR] [--profile P] [--refit]
        [--break-even]

RESULTS_DIR (default: benches/gpu/results/h200-2026-12-04): one GPU run's files, decode_step.py's
forward costs and routing_step.py's serving rows. Prints each row's measured tokens/s beside
the clock's for the same schedule, isolated forwards and with the engine's overhead, and the
error. --refit writes the overhead fitted from the warm routed rows (RESULTS_DIR/engine.json;
with --profile, also the profile's data/<profile>.engine.json). --break-even: the escalation
rate at which each routed row would cost what the large model alone does.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

# sim/ needs torch: imported once the arguments are read, so --help works without it
PROFILES = ("h200-2026-12-04", "h200-2026-11-30")
ROOT = Path(__file__).resolve().parents[3]
DEFAULT_RESULTS = ROOT / "benches" / "gpu" / "results" / "h200-2026-12-04"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", nargs="?", type=Path, default=DEFAULT_RESULTS)
    ap.add_argument(
        "--profile",
        default=None,
        choices=PROFILES,
        help="price with this shipped profile (default: the run's own decode_step.py file "
        "when the folder has one, else the default profile)",
    )
    ap.add_argument("--refit", action="store_true", help="write the fitted engine overhead")
    ap.add_argument("--break-even", action="store_true", help="the break-even escalation rate")
    a = ap.parse_args(argv)
    if not a.results.is_dir():
        ap.error(f"{a.results}: not a folder of GPU results")
    from ..sim.clock import DEFAULT_PROFILE
    from ..sim.clock_check import ClockSource, forwards_file, refit, report, schedules

    if not schedules(a.results):
        raise SystemExit(f"{a.results}: no serving rows (routing_step*.json) to check")
    own = None if a.profile else forwards_file(a.results)
    source = ClockSource(forwards=own) if own else ClockSource(profile=a.profile or DEFAULT_PROFILE)
    if a.refit:
        body = refit(source, a.results)
        print(f"engine overhead written to {a.results / 'engine.json'}:")
        print(json.dumps(body["overhead"], indent=1))
    print(report(source, a.results, a.break_even))
