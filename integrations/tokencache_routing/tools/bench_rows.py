"""The routing benchmark's rows: one system at one workload point (Row), the limits computed
from a run's rows (ideal, ceiling), the report's order, and the rows of earlier runs'
bench.json reloaded."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("naive", "naive-sglang", "tokencache", "threaded")
BOUNDS = ("small alone", "large alone")
LIMITS = ("ceiling", "ideal")  # computed from the rows, not run


@dataclass
class Row:
    context: int
    p: float
    system: str
    clock: str
    requests: int
    tokens: int
    seconds: float  # engine clock
    tokens_per_s: float
    ttft_p50_ms: float
    # Inter-token latency: the gaps between consecutive tokens of a request, over all tokens
    # (what this table called "TPOT" before 2026-12-02).
    itl_p50_ms: float
    itl_p99_ms: float
    occupancy: float
    small_steps: int
    catchups: int
    mean_catchup_batch: float
    bookkeeping_share: float  # tree and cursor time over the engine clock's time
    large_s: float = 0.0  # the large model's share of the clock (for the ideal)
    large_floor_s: float = 0.0  # the least the large model's work costs (for the ceiling)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    workload: str = "shared-prompt"
    max_new: int = 0  # new tokens per request (EOS-free: every request writes them all)
    max_running: int = 0  # the small batch cap: the concurrency of a --concurrency sweep
    # The engine's host time per small step (everything but the forward's device work,
    # Stats.small_host_s) and the share of the small model's device time spent waiting for
    # the host (Stats.device_idle_s: all the host time without overlap, the late launches
    # with it) over idle + busy. Event-loop rows only (0 for threaded ones).
    host_ms_per_small_step: float = 0.0
    gpu_idle_share: float = 0.0
    # Time per output token as vLLM's and SGLang's serving benchmarks define it: per request,
    # (last token's time - first token's) / (tokens - 1), its percentiles over requests
    # (NaN in rows of older runs, which kept only the gaps).
    tpot_p50_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    # Graph coverage: the share of both models' forwards that did not run eagerly (CUDA-graph
    # replays; off CUDA, a graph runner's static path), Stats.graph_share; the counts by path
    # are in extra["forward_paths"]. NaN in rows of older runs.
    graph_share: float = math.nan


def point(r: Row) -> tuple[str, int, int, int]:
    """Rows at one point of the workload (compared with each other: x naive, the limits)."""
    return r.workload, r.context, r.max_new, r.max_running


def limit_row(rows: list[Row], at: tuple[str, int, int, int], p: float, kind: str) -> Row | None:
    """ideal: small-alone time plus the tokencache run's large catch-up time (this schedule's
    catch-ups, nothing waiting). ceiling: small-alone time (full batches of max_running) plus
    the least the large model's tokens and KV reads in this run can cost on the clock
    (GpuClock.floor_s of GpuClock.least_kv_read: with shared-prefix reads, each escalation's
    context beyond the shareable prefix, and that prefix read as few times as possible): no
    one-device schedule computing those tokens beats it, but for the bookkeeping measured on
    this CPU (GPU clock only). `at`: the workload point (point(row))."""
    alone = next((r for r in rows if r.system == "small alone" and point(r) == at), None)
    tc = next((r for r in rows if r.system == "tokencache" and (point(r), r.p) == (at, p)), None)
    if alone is None or tc is None or (kind == "ceiling" and not tc.large_floor_s):
        return None
    large = tc.large_s if kind == "ideal" else tc.large_floor_s
    # Two devices: the models run side by side, so the slower of the two bounds the run.
    two = tc.extra.get("topology") == "two-devices"
    seconds = max(alone.seconds, large) if two else alone.seconds + large
    nan = float("nan")
    return Row(tc.context, p, kind, tc.clock, tc.requests, tc.tokens, seconds,
               tc.tokens / seconds, nan, nan, nan, 1.0, alone.small_steps, tc.catchups,
               tc.mean_catchup_batch, 0.0, workload=tc.workload, max_new=tc.max_new,
               max_running=tc.max_running)  # fmt: skip


def add_limits(rows: list[Row]) -> None:
    """Appends the ideal and ceiling rows at each workload point and rate that lacks them."""
    for at_point in dict.fromkeys(point(r) for r in rows if r.system not in LIMITS):
        for p in sorted({r.p for r in rows if r.system not in BOUNDS}):
            for kind in LIMITS:
                known = any((point(r), r.p, r.system) == (at_point, p, kind) for r in rows)
                r = None if known else limit_row(rows, at_point, p, kind)
                if r is not None:
                    rows.append(r)


def sort_for_report(rows: list[Row]) -> None:
    """By workload point, then rate (the bounds first, at any rate), then bounds, limits,
    systems."""
    order = {s: i for i, s in enumerate([*BOUNDS, *LIMITS, *SYSTEMS])}
    rows.sort(
        key=lambda r: (
            r.workload,
            r.max_running,
            r.context,
            r.p if r.system not in BOUNDS else -1,
            order[r.system],
        )
    )


def _renamed(r: dict[str, Any]) -> dict[str, Any]:
    """A row of a run before 2026-12-02, whose "tpot" figures were the per-token gaps (ITL),
    in today's names (its per-request TPOT unknown: NaN)."""
    if "itl_p50_ms" in r:
        return r
    r = dict(r)
    r["itl_p50_ms"], r["itl_p99_ms"] = r.pop("tpot_p50_ms"), r.pop("tpot_p99_ms")
    extra = r["extra"] = dict(r.get("extra", {}))
    for q in ("p50", "p99", "max"):
        if f"tpot_small_{q}_ms" in extra:
            extra[f"itl_small_{q}_ms"] = extra.pop(f"tpot_small_{q}_ms")
    return r


def load_rows(paths: Sequence[str]) -> tuple[list[Row], dict[str, Any]]:
    """Rows of earlier runs' bench.json files (merged: say, one run per output length), and
    the first file's arguments with each workload and concurrency of them all."""
    rows: list[Row] = []
    args: dict[str, Any] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += [Row(**_renamed(r)) for r in data["rows"] if r["system"] not in LIMITS]
        mine = data["args"]
        if not args:
            args = dict(mine)
            args["workloads"], args["concurrency"] = [], []
        args["workloads"] += [w for w in mine["workloads"] if w not in args["workloads"]]
        args["concurrency"] += [c for c in mine["concurrency"] if c not in args["concurrency"]]
        args["no_bounds"] = args["no_bounds"] and mine["no_bounds"]
    args["from_json"] = list(paths)
    return rows, args
