"""tokencache-bench: replay one token-routing trace through tokencache and SGLang's caches."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tokencache_bench.impls import IMPLS, Impl, factory
from tokencache_bench.memory import rss_in_subprocesses, traced_bytes_per_token
from tokencache_bench.plot import plot_handoffs
from tokencache_bench.replay import Timings, replay
from tokencache_bench.report import (
    Memory,
    handoff_table,
    median_by_bucket,
    step_median,
    step_table,
    summary_table,
    verification_table,
    verify,
)
from tokencache_bench.trace import Trace, TraceConfig, make_trace, take_gen, take_requests
from tokencache_extras import MissingExtra, require

MEM_GEN = 2048  # generated tokens in the memory replays
MEM_TRACED_REQUESTS = 4  # tracemalloc slows Python trees several-fold


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokencache-bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="CI smoke run, well under 30 s")
    p.add_argument("--requests", type=int, default=32, help="concurrent requests R")
    p.add_argument("--system-len", type=int, default=512, help="shared system prompt S")
    p.add_argument("--question-len", type=int, default=32, help="per-request prompt tokens")
    p.add_argument("--p", type=float, default=0.05, help="per-step escalation probability")
    p.add_argument("--max-gen", type=int, default=8192, help="generated tokens L per request")
    p.add_argument("--buckets", default="512,1024,2048,4096,8192", help="L bucket upper bounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slow-requests",
        type=int,
        default=8,
        help="requests the pure-Python SGLang trees replay in the per-L run (their cost per "
        "hand-off hardly depends on R, their wall time does)",
    )
    p.add_argument("--step-batches", default="32,256", help="batch sizes for the per-step run")
    p.add_argument(
        "--step-gen", type=int, default=1024, help="generated tokens in the per-step run"
    )
    p.add_argument("--only", default="", help="comma-separated implementation keys to run")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.max_gen = min(args.max_gen, 1024)
        args.buckets = "256,512,1024"
        args.slow_requests = min(args.slow_requests, 4)
        args.step_gen = min(args.step_gen, 256)
    return args


def _available(impls: tuple[Impl, ...]) -> tuple[list[Impl], list[str]]:
    ok, skipped = [], []
    for impl in impls:
        try:
            if impl.needs == "sglang" or impl.needs.startswith("tokencache_sglang"):
                from tokencache_sglang.sglang_import import import_sglang

                import_sglang()
            importlib.import_module(impl.needs)
            ok.append(impl)
        except (ImportError, OSError, RuntimeError) as exc:  # cannot run here: skip, say why
            skipped.append(f"{impl.key}: skipped, `import {impl.needs}` failed: {exc!r}")
    return ok, skipped


def _progress(total: int, enabled: bool) -> Any:  # a tqdm bar or a no-op stand-in
    if enabled:
        try:
            tqdm = require("tqdm", extra="bench").tqdm
            return tqdm(total=total, unit="hand-off", file=sys.stderr, smoothing=0.1)
        except MissingExtra as exc:
            print(f"no progress bar: {exc}", file=sys.stderr)

    class _Null:
        def update(self, n: int) -> None: ...
        def set_description(self, s: str) -> None: ...
        def close(self) -> None: ...

    return _Null()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started = time.perf_counter()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    config = TraceConfig(
        requests=args.requests,
        system_len=args.system_len,
        question_len=args.question_len,
        escalation_p=args.p,
        max_gen=args.max_gen,
        buckets=buckets,
        seed=args.seed,
    )
    impls, skipped = _available(IMPLS)
    if args.only:
        wanted = set(args.only.split(","))
        impls = [i for i in impls if i.key in wanted]
    for line in skipped:
        print(line, file=sys.stderr)
    if not any(i.key == "cursors" for i in impls):
        print("tokencache does not import: no reference, ratios will read n/a", file=sys.stderr)

    # Imports are done: move everything alive now out of the collector's sight, so a full
    # collection during a replay walks the trees, not torch and sglang (a running SGLang
    # server offers the same through its freeze_gc request).
    gc.collect()
    gc.freeze()
    main_trace = make_trace(config)
    slow_trace = take_requests(main_trace, args.slow_requests)
    step_traces: dict[int, Trace] = {}
    for batch in (int(b) for b in args.step_batches.split(",")):
        if batch == config.requests:
            step_traces[batch] = take_gen(main_trace, args.step_gen)
        else:
            step_config = replace(
                config, requests=batch, max_gen=args.step_gen, seed=args.seed + batch
            )
            step_traces[batch] = make_trace(step_config)

    # The per-L run; slow trees replay the first requests, and the cursor reference replays
    # that sub-trace too, so each ratio compares runs over the identical trace.
    plan: list[tuple[Impl, Trace]] = [(i, slow_trace if i.slow else main_trace) for i in impls]
    if slow_trace is not main_trace and any(i.slow for i in impls):
        plan += [(i, slow_trace) for i in impls if i.key == "cursors"]
    step_plan = [(b, i, t) for b, t in step_traces.items() for i in impls]

    total = sum(len(t.handoffs) for _, t in plan) + sum(len(t.handoffs) for _, _, t in step_plan)
    bar = _progress(total, not args.no_progress)
    # A tiny replay per implementation first: lazy imports and one-time native set-up land
    # there, not in the timings or the RSS growth.
    warm = take_gen(take_requests(main_trace, 2), min(64, config.max_gen))
    for impl in impls:
        replay(factory(impl), warm)
    runs: list[Timings] = []
    for impl, trace in plan:
        bar.set_description(impl.key)
        runs.append(replay(factory(impl), trace, bar.update))
    step_runs: dict[int, list[Timings]] = {b: [] for b in step_traces}
    for batch, impl, trace in step_plan:
        bar.set_description(f"{impl.key} x{batch}")
        step_runs[batch].append(replay(factory(impl), trace, bar.update))
    bar.close()

    # Memory: tracemalloc in-process for Python trees; RSS growth per tree in a fresh process
    # (skipped by --quick: each child re-imports sglang).
    mem_gen = min(MEM_GEN, config.max_gen)
    mem_trace = take_gen(take_requests(main_trace, MEM_TRACED_REQUESTS), mem_gen)
    traced: dict[str, Memory] = {}
    for impl in impls:
        cls = factory(impl)
        if cls.python_heap:
            traced[cls.name] = traced_bytes_per_token(cls, mem_trace)
    rss: dict[str, Memory] = {}
    if not args.quick:
        rss = rss_in_subprocesses([i.key for i in impls], config, config.requests, mem_gen)
    memory = {"rss": rss, "tracemalloc": traced}

    all_runs = runs + [t for ts in step_runs.values() for t in ts]
    verify(all_runs)
    wall = time.perf_counter() - started

    text = _render(args, config, main_trace, slow_trace, runs, step_runs, memory, skipped, wall)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(_raw(runs, step_runs, memory), indent=1))
    written = [args.out / "report.md", args.out / "results.json"]
    try:
        plot_handoffs(
            runs,
            args.out / "handoff_vs_L.png",
            f"hand-off cost vs L (R={config.requests}, S={config.system_len}, "
            f"p={config.escalation_p})",
        )
        written.append(args.out / "handoff_vs_L.png")
    except MissingExtra as exc:
        print(f"\nplot skipped: {exc}", file=sys.stderr)
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0


def _render(
    args: argparse.Namespace,
    config: TraceConfig,
    main_trace: Trace,
    slow_trace: Trace,
    runs: list[Timings],
    step_runs: dict[int, list[Timings]],
    memory: dict[str, dict[str, Memory]],
    skipped: list[str],
    wall: float,
) -> str:
    from tokencache_sglang.sglang_import import sglang_version

    try:
        sglang = sglang_version()
    except ImportError:
        sglang = "not importable"
    out = [
        "# tokencache-bench" + (" (--quick)" if args.quick else ""),
        "",
        (
            f"Trace {main_trace.fingerprint}: R={config.requests} requests, shared system prompt "
            f"S={config.system_len}, {config.question_len} own prompt tokens each, escalation "
            f"p={config.escalation_p}, L={config.max_gen} generated tokens, seed {config.seed}, "
            f"{len(main_trace.handoffs)} hand-offs of median "
            f"{int(np.median([h.end - h.start for h in main_trace.handoffs]))} tokens; page_size 1."
        ),
        (
            f"Pure-Python SGLang trees replay the first {slow_trace.requests} requests only "
            f"(trace {slow_trace.fingerprint}); the cursor reference replays that same sub-trace "
            "for their ratios."
        ),
        (
            f"Python {platform.python_version()}, sglang {sglang}, numpy {np.__version__}, "
            f"{platform.machine()}; total wall {wall:.0f} s."
        ),
        (
            "Times are time.perf_counter_ns around each call; input arrays are built outside the "
            "timed region. extend_many rows: one call per decode step, divided by its hand-offs."
        ),
        "",
    ]
    if skipped:
        out += ["Skipped:", *[f"- {s}" for s in skipped], ""]
    out += [
        "## Summary: median microseconds per hand-off",
        "",
        summary_table(runs, memory),
        "",
        (
            "Growth exponent: slope of log(median hand-off time) against log(L) over the buckets. "
            f"RSS bytes per cached token: resident-set growth of a fresh process replaying all "
            f"{config.requests} requests to L={min(MEM_GEN, config.max_gen)} (page "
            "granular, includes allocator slack; not measured with --quick). tracemalloc: "
            "Python-heap bytes "
            f"after a {MEM_TRACED_REQUESTS}-request replay to the same L, Python trees only "
            "(torch tensor storage is outside it)."
        ),
        "",
        "## Per hand-off by operation: median / p90 microseconds",
        "",
        handoff_table(runs),
        "",
        f"## Per decode step, L<={args.step_gen}: microseconds of cache work per step",
        "",
        (
            "Every request of the batch decodes one token per step; a step's cost is the sum of "
            "its hand-offs (one extend_many call for the batched row). The median is over steps "
            "with at least one hand-off; the mean is over all steps (those without cost 0) and "
            "so moves with any single stall, e.g. the OS preempting the process."
        ),
        "",
        step_table(step_runs),
        "",
        "## Same trace, same result",
        "",
        verification_table(runs + [t for ts in step_runs.values() for t in ts]),
        "",
        "Checked: every implementation ended with the trace's cached token count.",
    ]
    return "\n".join(out)


def _raw(
    runs: list[Timings], step_runs: dict[int, list[Timings]], memory: dict[str, dict[str, Memory]]
) -> dict[str, Any]:
    return {
        "per_L": [
            {"name": t.name, "trace": t.trace_fingerprint, "median_us": median_by_bucket(t)}
            for t in runs
        ],
        "per_step": {
            str(b): [
                {
                    "name": t.name,
                    "mean_step_us": {
                        int(k): float(t.step_ns[t.step_buckets == k].mean()) / 1000
                        for k in np.unique(t.step_buckets)
                    },
                    "median_busy_step_us": {
                        int(k): step_median(t, int(k)) for k in np.unique(t.step_buckets)
                    },
                }
                for t in ts
            ]
            for b, ts in step_runs.items()
        },
        "memory": {kind: {k: vars(v) for k, v in m.items()} for kind, m in memory.items()},
    }


if __name__ == "__main__":
    raise SystemExit(main())
