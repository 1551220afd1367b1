"""The launch policy judged on the refit GPU clock: when a catch-up launches, how large it is,
and whether the small model's batch is kept full while requests are parked.

Every row is the routing benchmark's tokencache row (tokencache_routing.tools.bench) on the
reasoning workload (32 requests per 32 places, 128 shared + 128 own prompt tokens, 2048 new,
p = 0.1), its forwards stubbed (--stub-device: the schedule is the engine's, the device time
the clock's) and priced by the default GpuClock profile: the 2026-12-04 H200 forwards plus
the engine overhead fitted from that run's serving rows (tools/clock_check.py). So every
figure is a PROJECTION of that clock; the check command gives its measured error. Each
setting is compared with the large model alone on the same requests, priced the same way.

    python benches/launch_policy.py                 # the table (about 2 minutes on 2 cores)
    python benches/launch_policy.py --quick         # 256 new tokens (seconds)
    python benches/launch_policy.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

# (name, the bench's flags): the setting the H200 ran first, then one knob at a time
SETTINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("min_occupancy 0.8 (as measured on the H200)", ("--min-occupancy", "0.8")),
    ("min_occupancy 0.5 (the default)", ()),
    ("min_occupancy 0.3", ("--min-occupancy", "0.3")),
    ("0.8, min_large_batch 8", ("--min-occupancy", "0.8", "--min-large-batch", "8")),
    ("0.8, max_wait 64 steps", ("--min-occupancy", "0.8", "--max-wait", "64")),
    ("launch cost", ("--launch", "cost")),
    ("a queue: 2 requests a place, 0.8", ("--requests-per-slot", "2", "--min-occupancy", "0.8")),
    ("a queue, 0.5", ("--requests-per-slot", "2")),
)
COMMON = ("--workload", "reasoning", "--stub-device", "--clock", "gpu", "--rates", "0.1")


def run_bench(flags: Sequence[str], out: Path, quick: bool) -> dict[str, dict[str, Any]]:
    """One bench run (a process of its own: the clock and the engine fresh); its rows by
    system."""
    cmd = [sys.executable, "-m", "tokencache_routing", "bench", *COMMON, *flags]
    cmd += ["--dispatches", "tokencache", "--out", str(out)]
    if quick:
        cmd += ["--max-new", "256"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = json.loads((out / "bench.json").read_text())["rows"]
    return {r["system"]: r for r in rows}


def sweep(quick: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, flags) in enumerate(tqdm(SETTINGS, desc="launch policy", unit="row")):
            rows = run_bench(flags, Path(tmp) / str(i), quick)
            routed, alone = rows["tokencache"], rows["large alone"]
            out.append(
                {
                    "setting": name,
                    "flags": " ".join(flags),
                    "tokens_per_s": routed["tokens_per_s"],
                    "large_alone_tokens_per_s": alone["tokens_per_s"],
                    "x_large_alone": routed["tokens_per_s"] / alone["tokens_per_s"],
                    "tpot_p50_ms": routed["tpot_p50_ms"],
                    "itl_p99_ms": routed["itl_p99_ms"],
                    "occupancy": routed["occupancy"],
                    "catchups": routed["catchups"],
                    "mean_catchup_batch": routed["mean_catchup_batch"],
                }
            )
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| setting | tok/s | x large alone | TPOT p50 ms | ITL p99 ms | occupancy "
        "| catch-ups | mean catch-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['tokens_per_s']:.0f} | {r['x_large_alone']:.2f}x"
            f" | {r['tpot_p50_ms']:.1f} | {r['itl_p99_ms']:.0f} | {r['occupancy']:.0%}"
            f" | {r['catchups']} | {r['mean_catchup_batch']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 new tokens a request")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    a = ap.parse_args(argv)
    rows = sweep(a.quick)
    print("PROJECTION on the refit GPU clock (h200-2026-12-04 + engine overhead); p = 0.1")
    print(table(rows))
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
