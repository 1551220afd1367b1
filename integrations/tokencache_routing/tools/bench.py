"""Serving benchmark of routed decode: naive dispatchers vs tokencache cursors, one harness.

    python -m tokencache_routing bench [--quick] [--clock gpu|measured]
        [--profile h200-2026-11-30|h200-roofline] [--[no-]shared-prefix] [--large-tp N]
        [--workload shared-prompt|reasoning|long-input] [--max-new 512 2048 8192]
        [--concurrency 1 4 8 16 32 64 128] [--breakdown-steps 128]
        [--contexts 2048 8192] [--rates 0.05 0.1 0.2] [--max-running 32]
        [--system-prompts K] [--dispatches naive naive-sglang tokencache threaded] [--out DIR]

Workloads (bench_workloads.py; every request EOS-free, so every system writes the same
tokens): shared-prompt (the default, described next), reasoning (a 128-token shared system
prompt + 128 own tokens, 2048 new: long generations, where the naive trees get deep) and
long-input (2048 shared + 6144 own, 1024 new). --concurrency sweeps max_running (N =
--requests-per-slot x C); several --max-new values sweep the output length; both print a
summary table and a plot (bench_concurrency.png, bench_length.png). For reasoning and
long-input the report adds the per-step breakdown over the last 128 small steps (small and
large forward, tree insert/update, prefix match, lock, unlock, the rest) beside the published
one (TokenRouter, arXiv 2610.12242).

A serving workload: N = --requests-per-slot x max_running requests (a system prompt plus each
request's own text, --context tokens in all once generated) submitted at once and admitted
continuously as places free up. Request i starts with system prompt i mod K of K distinct ones
(--system-prompts, default 1: one prompt shared by all), each of the same length, all primed
in both trees. Tiny random models compute the tokens on this CPU; the engine clock prices every
forward (default --clock gpu: a GpuClock at Qwen3-0.6B / Qwen3-8B shapes on a GPU cost profile
fitted to H200 measurements, plus the tree bookkeeping measured here), so a schedule is judged
by GPU-shaped costs. Every system runs on the same modelled runner: with --shared-prefix (the
roofline profile's default) it reads the slot-list prefix each group of a forward's rows
shares (their system prompt) once per block of the group's query rows, not once per row; the
report's clock line says which, and how many system prompts. "threaded" runs on wall time (its
two workers really overlap), so its rows are CPU measurements whatever the clock.

Per (context, p, system): decode tokens/s, time to first token, TPOT (per request, as the
serving benchmarks define it) and ITL (every inter-token gap) p50/p99 (engine clock),
small-model batch occupancy (batch / min(max_running, admitted requests)), small steps,
catch-up batches, bookkeeping share (tree and cursor time measured here, over the
engine clock's time); bounds: the small model alone, the large model alone, the ideal
(small-alone time plus the tokencache run's large catch-up time) and the ceiling (small-alone
time plus the least the large model's tokens and KV reads can cost: each escalation's context,
less, with shared-prefix reads, the longest prefix two requests share, which is read only as
often as one forward of all of them would, whatever K: no one-device schedule beats it on the
GPU clock).
Markdown table on stdout, bench.json and bench.png (when matplotlib is installed) in --out.
The engine clock charges forwards and the engine's measured host time (RoutedEngine's
host_charge, default serial: with overlap the GPU waits only for what the pipeline cannot
hide; --host-charge trees charges the tree calls only); the report's
clock line says which. --stub-device times that host path without the CPU models' forwards
(zero logits, the same schedule): on this CPU each forward also evicts the host's caches. Its
host preparation is the GPU runner's (--stub-runner gpu, the default: what the engine does on
the GPU the clock prices) or this CPU's eager path (--stub-runner eager).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .bench_plots import plot_concurrency, plot_length, plot_rates
from .bench_report import report
from .bench_rows import SYSTEMS, add_limits, load_rows, sort_for_report
from .bench_run import measure
from .bench_workloads import WORKLOADS, resolve


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run (seconds)")
    ap.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="shared-prompt",
        help="shared-prompt: a long primed system prompt (--contexts) + 32 own, 32 new; "
        "reasoning: 128 shared + 128 own, 2048 new; long-input: 2048 shared + 6144 own, 1024 "
        "new (bench_workloads.py); every request EOS-free",
    )
    ap.add_argument("--clock", choices=["gpu", "measured"], default="gpu")
    ap.add_argument(
        "--profile",
        default=None,
        help="GpuClock profile, or a JSON of GPU measurements to fit (data/*.json's rows, or a "
        "benches/gpu/results/ file that decode_step.py wrote)",
    )
    ap.add_argument(
        "--shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether the clock's runner reads a forward's shared slot-list prefix once "
        "(default: the profile's: on for h200-roofline, off for measured fits)",
    )
    ap.add_argument("--small-shape", default="qwen3-0.6b", help="model shape the clock prices")
    ap.add_argument("--large-shape", default="qwen3-8b")
    ap.add_argument(
        "--large-tp",
        type=int,
        default=1,
        metavar="N",
        help="price the large model tensor-parallel over N GPUs (tp_cost.py: each rank's "
        "roofline share plus the all-reduces at published NVLink figures; h200-roofline only); "
        "'large alone' is then the large model alone on its N GPUs",
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[2048, 8192], help="shared-prompt only"
    )
    ap.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        metavar="C",
        help="a sweep: each C as max_running, N = requests-per-slot x C (default: --max-running)",
    )
    ap.add_argument(
        "--requests-per-slot",
        type=int,
        default=None,
        help="N = this x max_running (default: 4 for shared-prompt, 1 otherwise)",
    )
    ap.add_argument(
        "--max-new", type=int, nargs="+", default=None, help="new tokens (default: the workload's)"
    )
    ap.add_argument(
        "--unique-prompt", type=int, default=None, help="each request's own tokens (workload's)"
    )
    ap.add_argument(
        "--system-tokens",
        type=int,
        default=None,
        help="system prompt length (reasoning, long-input: the workload's; shared-prompt: "
        "what --contexts leaves)",
    )
    ap.add_argument(
        "--system-prompts",
        type=int,
        default=1,
        metavar="K",
        help="distinct system prompts (each of the same length; request i gets prompt i mod K)",
    )
    ap.add_argument(
        "--warm-up",
        choices=["pass", "full", "none"],
        default="pass",
        help="before each row's timed window: pass (the workload once, shorter and on other "
        "prompts: its compiles and graph captures), full (RoutedEngine.warm_up: every graph "
        "the engine can replay, as a server) or none (a cold row)",
    )
    ap.add_argument(
        "--breakdown-steps",
        type=int,
        default=None,
        help="print the per-step breakdown over the last this many small steps (default: 128 "
        "for reasoning and long-input, off for shared-prompt)",
    )
    ap.add_argument(
        "--launch",
        choices=["threshold", "cost"],
        default="threshold",
        help="SchedulerConfig.launch: when a catch-up launches on one device: threshold "
        "(--min-large-batch, --max-wait, --min-occupancy) or cost (when the holes' accumulated "
        "cost on the clock reaches a catch-up's fixed cost; --max-wait then caps the wait, "
        "default no cap)",
    )
    ap.add_argument("--min-large-batch", type=int, default=32)
    ap.add_argument(
        "--max-wait",
        type=int,
        default=None,
        help="max wait in small steps (default 8; with --launch cost 0: no cap)",
    )
    ap.add_argument("--min-occupancy", type=float, default=0.5, help="SchedulerConfig's")
    ap.add_argument(
        "--max-parked", type=int, default=None, help="SchedulerConfig's (default: max-running)"
    )
    ap.add_argument(
        "--max-wait-ms",
        type=float,
        default=None,
        help="threaded: max wait (ms; default 5; with --launch cost 0: no cap)",
    )
    ap.add_argument(
        "--chunked-prefill",
        type=int,
        default=None,
        metavar="N",
        help="SchedulerConfig.chunked_prefill_size: the most tokens a step computes, a long "
        "prefill or catch-up split across steps (0: off; default: SchedulerConfig's, 2048)",
    )
    ap.add_argument(
        "--large-chunked-prefill",
        type=int,
        default=None,
        metavar="N",
        help="SchedulerConfig.large_chunked_prefill_size: the catch-ups' budget (0: off; "
        "default: --chunked-prefill's)",
    )
    ap.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="requests arrive as a Poisson process of R a second on the engine clock, seeded "
        "by --seed (bench_workloads.arrival_times; TTFT counts from each arrival; event-loop "
        "rows only); 0 (default): all at once",
    )
    ap.add_argument("--dispatches", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument(
        "--topology",
        choices=["one-device", "two-devices"],
        default="one-device",
        help="event loop clock: catch-ups between small steps, or beside them on a second GPU",
    )
    ap.add_argument(
        "--no-bounds", action="store_true", help="skip small/large alone, ideal and ceiling"
    )
    ap.add_argument(
        "--host-charge",
        default=None,
        help="RoutedEngine's host_charge, where the engine has it (serial, overlap or trees); "
        "default: the engine's",
    )
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="tokencache without overlapped scheduling (EngineConfig(overlap=False)): the "
        "serial host path, every host microsecond on the GPU's clock",
    )
    ap.add_argument(
        "--stub-device",
        action="store_true",
        help="the CPU models' forwards return zero logits at once "
        "(tokencache_models.testing.stubbed_device): the host path timed without them (on "
        "this CPU each also evicts the host's caches between steps, which a GPU's forward does "
        "not); the schedule is the same (the Bernoulli router and EOS-free lengths ignore the "
        "logits), the tokens are 0. GPU clock only",
    )
    ap.add_argument(
        "--stub-runner",
        choices=("gpu", "eager"),
        default=None,
        help="with --stub-device, whose host preparation the forwards get: gpu (default), what "
        "the engine prepares on the GPU the clock prices (Triton's plan and shared-prefix "
        "tables, decode steps padded into a graph runner's buffers); eager, this CPU's torch "
        "path (ForwardContext.build each step)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/routing", help="folder for bench.json, bench.png")
    ap.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: report (tables, plots) the rows of earlier runs' bench.json, merged",
    )
    a = ap.parse_args(argv)
    if a.system_prompts < 1:
        ap.error(f"--system-prompts must be >= 1, got {a.system_prompts}")
    for name in ("chunked_prefill", "large_chunked_prefill"):
        if (getattr(a, name) or 0) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0 (0: off)")
    for name in ("concurrency", "max_new"):
        if any(v < 1 for v in getattr(a, name) or ()):
            ap.error(f"--{name.replace('_', '-')} values must be >= 1")
    if a.large_tp < 1:
        ap.error(f"--large-tp must be >= 1, got {a.large_tp}")
    if a.large_tp > 1 and (a.clock != "gpu" or a.profile != "h200-roofline"):
        ap.error("--large-tp prices the h200-roofline profile only (a measured fit is one GPU's)")
    if not math.isfinite(a.arrival_rate) or a.arrival_rate < 0:
        ap.error(f"--arrival-rate must be a finite number >= 0, got {a.arrival_rate}")
    if a.arrival_rate and "threaded" in a.dispatches:
        ap.error("--arrival-rate schedules arrivals on the event loop's clock: no threaded rows")
    if a.stub_device and (a.clock != "gpu" or "threaded" in a.dispatches):
        ap.error("--stub-device needs --clock gpu and no threaded rows (their time is wall time)")
    if a.stub_runner is not None and not a.stub_device:
        ap.error("--stub-runner chooses the stubbed models' host path: it needs --stub-device")
    if a.stub_device and a.stub_runner is None:
        a.stub_runner = "gpu"
    cost = a.launch == "cost"
    if a.max_wait is None:
        a.max_wait = 0 if cost else 8
    if a.max_wait_ms is None:
        a.max_wait_ms = 0.0 if cost else 5.0
    if a.quick:
        a.contexts, a.rates, a.max_running, a.min_large_batch = [96], [0.1], 4, 2
    a.points = resolve(a)  # fills the workload's defaults in
    if a.breakdown_steps is None:
        a.breakdown_steps = 0 if a.workload == "shared-prompt" else 128
    a.concurrency = a.concurrency or [a.max_running]
    a.progress = True
    return a


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, args = load_rows(a.from_json) if a.from_json else measure(a, out)
    if not args.get("no_bounds"):
        add_limits(rows)
    sort_for_report(rows)
    report(rows, args)
    (out / "bench.json").write_text(
        json.dumps({"args": args, "partial": False, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    cs = sorted({r.max_running for r in rows})
    news = sorted({r.max_new for r in rows})
    plots = []
    if len(cs) > 1 and plot_concurrency(rows, out / "bench_concurrency.png"):
        plots.append(out / "bench_concurrency.png")
    if len(news) > 1 and plot_length(rows, out / "bench_length.png"):
        plots.append(out / "bench_length.png")
    if len(cs) == 1 and len(news) == 1 and plot_rates(rows, out / "bench.png"):
        plots.append(out / "bench.png")
    for path in plots:
        print(f"\nplot: {path}")
    print(f"json: {out / 'bench.json'}")
