"""The routing serving benchmark (tokencache_routing.tools.bench) at real shapes on a GPU.

Run on a CUDA machine (no network needed):   python benches/gpu/routing_step.py
    --large qwen3-32b   a 32B-shaped large model instead of 8B
    --two-devices       small model on cuda:0, large on cuda:1 (when there are two GPUs)
    --workload reasoning  the long-generation workload: a 128-token shared system
                        prompt + 128 own tokens, 2048 new tokens per request, 32 requests, p = 0.1;
                        tokencache, the large model alone and naive-sglang first (the targets), then
                        tokencache without overlap, naive, the bounds; per-step breakdown over
                        the last 128 small steps (tree calls synchronised)
    --overlap both|on|off tokencache with overlapped scheduling (EngineConfig(overlap=True), the
                        default), without it (the serial path: system "tokencache (serial)"),
                        or both (default; the serial row right after the target pair)
    --smoke             the same code path on CPU with tiny configs, in seconds

Random bf16 weights at Qwen3-0.6B (small) and Qwen3-8B (large) shapes; a Bernoulli router
escalates each token with probability p. Rows run target first: at p = 0.1, context by context
in the order given, tokencache and the target's baseline (shared-prompt: naive, the >=
1.5x at 8192; reasoning: naive-sglang, >= 5x), tokencache without overlap, the other dispatches;
then the bounds at each context; then the other rates. The workload is the CPU bench's: N = 4 x
max_running requests, a shared system prompt (primed in both trees) plus each request's own
tokens, admitted continuously. The engine clock is "measured": forwards and tree calls
synchronised on CUDA, so each row's tokens/s is this GPU's (the threaded rows: wall time, the
two workers overlapping on one device through two CUDA streams). Writes $OUT/routing_step.json
and, with --results, benches/gpu/results/<device>-<date>-routing.json (rows: system, dispatch,
overlap, p, batch, context, tokens_per_s, ...; the reasoning workload's files end in
-reasoning), rewritten after every row so a run cut short keeps its rows. The GPU clock
is refitted from such files: tokencache_routing.GpuClock.fit(path, small, large).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))  # runs from a checkout without installing

from tokencache_models import PRESETS, ModelConfig, random_model  # noqa: E402
from tokencache_routing.tools import (  # noqa: E402
    bench_prompts,
    bench_report,
    bench_rows,
    bench_run,
    bench_workloads,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", default="qwen3-0.6b", choices=sorted(PRESETS))
    p.add_argument("--large", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--workload", choices=["shared-prompt", "reasoning"], default="shared-prompt")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192], help="shared-prompt")
    p.add_argument(
        "--rates", type=float, nargs="+", default=None, help="0.05 0.1 0.2; reasoning 0.1"
    )
    p.add_argument("--dispatches", nargs="+", choices=bench_rows.SYSTEMS, default=None)
    p.add_argument(
        "--overlap",
        dest="tokencache_overlap",
        choices=["both", "on", "off"],
        default="both",
        help="tokencache with overlapped scheduling, without, or both (default)",
    )
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--max-new", type=int, default=None, help="32; reasoning: 2048")
    p.add_argument("--unique-prompt", type=int, default=None, help="32; reasoning: 128")
    p.add_argument("--min-large-batch", type=int, default=32)
    p.add_argument("--max-wait", type=int, default=8)
    p.add_argument("--min-occupancy", type=float, default=0.5)
    p.add_argument("--max-parked", type=int, default=None, help="default: --max-running")
    p.add_argument("--max-wait-ms", type=float, default=20.0)
    p.add_argument("--two-devices", action="store_true", help="large model on cuda:1")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no run after this")
    p.add_argument(
        "--grace-s",
        type=float,
        default=60.0,
        help="nor one that its dispatch's last row (else the longest row so far) would carry "
        "past budget + this (run_all.sh's hard limit is ~10 s beyond)",
    )
    p.add_argument(
        "--results",
        nargs="?",
        const=str(ROOT / "benches" / "gpu" / "results"),
        default=None,
        metavar="DIR",
        help="also write <device>-<date>-routing*.json there (default: benches/gpu/results/)",
    )
    p.add_argument(
        "--large-alone-first",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the large model alone right after tokencache at each context (the headline "
        "ratio), before the baselines (default on)",
    )
    p.add_argument(
        "--warm-up",
        choices=["pass", "full", "none"],
        default="pass",
        help="before each row's timed window (python -m tokencache_routing bench --warm-up): "
        "pass, full or none",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny configs on CPU (checks the script)")
    a = p.parse_args(argv)
    a.clock, a.profile = "measured", "measured"
    a.no_overlap = False  # per row (bench_run.run reads it): the serial path for tokencache
    a.small_shape, a.large_shape = a.small, a.large
    a.topology = "two-devices" if a.two_devices else "one-device"
    a.system_tokens = None  # shared-prompt: the system prompt fills each context
    if a.workload == "reasoning":
        # One wave of 32 long generations (bench_workloads.DEFAULTS); the comparison the issue
        # asks for first, the bounds after it, no threaded rows: a budget that runs out still
        # leaves tokencache beside naive-sglang at 2048 new tokens.
        d = bench_workloads.DEFAULTS["reasoning"]
        a.requests_per_slot, a.system_tokens = d.requests_per_slot, d.shared
        a.max_new = a.max_new or d.max_new[0]
        a.unique_prompt = a.unique_prompt or d.unique
        a.rates = a.rates or [0.1]
        a.dispatches = a.dispatches or ["tokencache", "naive-sglang", "naive"]
    else:
        a.requests_per_slot = 4
        a.max_new, a.unique_prompt = a.max_new or 32, a.unique_prompt or 32
        a.rates = a.rates or [0.05, 0.1, 0.2]
        a.dispatches = a.dispatches or list(bench_rows.SYSTEMS)
    a.breakdown_steps = 128
    if a.smoke:
        a.contexts, a.rates, a.max_running, a.min_large_batch = [64], [0.2], 4, 2
        a.requests_per_slot = 2 if a.workload == "shared-prompt" else 1
        a.max_new, a.unique_prompt = (6, 4) if a.workload == "shared-prompt" else (24, 8)
        a.system_tokens = None if a.workload == "shared-prompt" else 40
        a.dispatches = [d for d in a.dispatches if d != "naive-sglang"]
    return a


def tiny_qwen3(layers: int, hidden: int) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
    )


def build(a: argparse.Namespace) -> tuple[Any, Any, int]:
    if a.smoke:
        cfgs, dev, dtype = (tiny_qwen3(1, 32), tiny_qwen3(2, 32)), ("cpu", "cpu"), torch.float32
    else:
        cfgs = (PRESETS[a.small], PRESETS[a.large])
        dev = ("cuda:0", "cuda:1" if a.two_devices else "cuda:0")
        dtype = torch.bfloat16
    small = random_model(cfgs[0], seed=1, device=dev[0], dtype=dtype).eval()
    large = random_model(cfgs[1], seed=2, device=dev[1], dtype=dtype).eval()
    return small, large, int(cfgs[0].vocab_size)


def write(result: dict[str, Any], a: argparse.Namespace) -> None:
    text = json.dumps(result, indent=1)
    tag = "" if a.workload == "shared-prompt" else f"-{a.workload}"
    if a.large != "qwen3-8b":  # another pair's rows go to files of their own
        tag += "-" + a.large.removeprefix("qwen3-")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"routing_step{tag}.json").write_text(text)
    if a.results:
        name = f"{result['device_slug']}-{result['date']}-routing{tag}.json"
        Path(a.results).mkdir(parents=True, exist_ok=True)
        Path(a.results, name).write_text(text)


SERIAL = "tokencache (serial)"  # tokencache without overlapped scheduling
MEMORY_SLACK = 64 << 20  # bytes a row may leave behind (the allocator's own bookkeeping)


def device_memory() -> int:
    """Bytes the CUDA allocator holds for tensors now (0 without CUDA)."""
    return (
        sum(torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count()))
        if torch.cuda.is_available()
        else 0
    )


def free_row_memory() -> int:
    """Frees what the finished row left (its engine's cycles collected, the allocator's cache
    emptied); returns device_memory() after."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return device_memory()


# The baseline each workload's target compares tokencache with: run right after it.
TARGET_BASELINE = {"shared-prompt": "naive", "reasoning": "naive-sglang"}


def plan(a: argparse.Namespace) -> list[tuple[int, float, str, bool | None]]:
    """The rows in the order they run: (context, p, dispatch or bound, overlap). At the target
    rate (p = 0.1, else the first), context by context in the order given: tokencache and its
    target baseline, tokencache without overlap (--overlap both), the other dispatches; then
    the bounds at each context; then the other rates. overlap: None for the engine's default
    (on for tokencache), False for the serial path."""
    base = TARGET_BASELINE.get(a.workload, "naive")
    lead = [s for s in ("tokencache", base) if s in a.dispatches]
    # The comparison a user makes first, routed against the large model alone: that bound
    # right after tokencache at each context, before the baselines.
    alone = [(ctx, 0.0, "large alone", None) for ctx in a.contexts] if a.large_alone_first else []
    settings: dict[str, list[bool | None]] = {"on": [None], "off": [False], "both": [None, False]}
    tc = settings[a.tokencache_overlap]
    routed: list[tuple[str, bool | None]] = []
    if "tokencache" in a.dispatches:
        routed.append(("tokencache", tc[0]))
    routed += [(s, None) for s in lead if s != "tokencache"]
    routed += [("tokencache", o) for o in tc[1:] if "tokencache" in a.dispatches]
    routed += [(s, None) for s in a.dispatches if s not in lead]
    first = [p for p in a.rates if p == 0.1] or a.rates[:1]
    rest = [p for p in a.rates if p not in first]
    bounds = [(b, None) for b in bench_rows.BOUNDS if not (alone and b == "large alone")]
    jobs: list[tuple[int, float, str, bool | None]] = []
    for ctx in a.contexts:
        mine = [(ctx, p, s, o) for p in first for s, o in routed]
        jobs += mine[:1] + [j for j in alone if j[0] == ctx] + mine[1:]
    jobs += [(ctx, 0.0, b, o) for ctx in a.contexts for b, o in bounds]
    return jobs + [(ctx, p, s, o) for p in rest for ctx in a.contexts for s, o in routed]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        print(
            "routing_step.py needs a CUDA device (use --smoke to check it on CPU)", file=sys.stderr
        )
        return 2
    if a.two_devices and torch.cuda.device_count() < 2:
        print("--two-devices needs two CUDA devices", file=sys.stderr)
        return 2
    device = "cpu (smoke)" if a.smoke else torch.cuda.get_device_name()
    small, large, vocab = build(a)
    result: dict[str, Any] = {
        "device": device,
        "device_slug": device.lower().replace(" ", "-"),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "small": a.small,
        "large": a.large,
        "two_devices": a.two_devices,
        "args": {k: v for k, v in vars(a).items() if k != "dispatches"}
        | {"dispatches": a.dispatches},
        "rows": [],
    }
    t_start = time.perf_counter()
    baseline = device_memory()  # the models alone: every row must leave the device so
    result["baseline_memory_bytes"] = baseline
    n = a.requests_per_slot * a.max_running
    rows: list[bench_rows.Row] = []
    if a.system_tokens is not None:  # reasoning: one shape, whatever --contexts says
        a.contexts = [a.system_tokens + a.unique_prompt + a.max_new]
    shared_of = {
        ctx: a.system_tokens or max(1, ctx - a.max_new - a.unique_prompt) for ctx in a.contexts
    }
    prompts_of = {
        ctx: bench_prompts.make_prompts(n, shared_of[ctx], a.unique_prompt, vocab, a.seed)
        for ctx in a.contexts
    }
    jobs = plan(a)
    # A row that would overrun is not started: its expected length is the last row of the same
    # dispatch (tokencache with and without overlap alike), else the longest row so far (s).
    longest, took = 0.0, dict[str, float]()
    for ctx, p, system, overlap in jobs:
        shared, prompts = shared_of[ctx], prompts_of[ctx]
        name = SERIAL if overlap is False else system
        elapsed = time.perf_counter() - t_start
        expect = took.get(system, longest)
        if elapsed > a.budget_s or elapsed + expect > a.budget_s + a.grace_s:
            print(f"budget of {a.budget_s:.0f} s spent: {name} p={p} L={ctx} not run")
            result["rows"].append(
                {"system": name, "p": p, "context": ctx, "skipped": "time budget"}
            )
            continue
        t_row = time.perf_counter()
        a.no_overlap = overlap is False
        try:
            row = bench_run.run(
                system, p, prompts, shared, a.max_new, (small, large), a, a.workload
            )
        except Exception as e:  # a row that fails says why; the others still run
            err = {
                "system": name,
                "dispatch": system,
                "p": p,
                "context": ctx,
                "error": f"{type(e).__name__}: {e}",
            }
            result["rows"].append(err)
            print(json.dumps(err), flush=True)
            write(result, a)
            continue
        finally:
            a.no_overlap = False
            left = free_row_memory()  # the row's engine, pools and graphs gone
        took[system] = time.perf_counter() - t_row
        longest = max(longest, took[system])
        row.system = name
        rows.append(row)
        d = dataclasses.asdict(row)
        d |= {"dispatch": system, "batch": a.max_running, "overlap": row.extra.get("overlap")}
        d["row_s"] = time.perf_counter() - t_row
        # Clean: what the device holds after the row against the models alone (a leak would
        # crowd the next row, as it once ran the 32B bounds out of memory).
        d["memory_left_bytes"] = left - baseline
        d["memory_clean"] = left - baseline <= MEMORY_SLACK
        result["rows"].append(d)
        print(json.dumps(d), flush=True)
        write(result, a)
    result["wall_s"] = time.perf_counter() - t_start
    write(result, a)
    print()
    order = {s: i for i, s in enumerate([*bench_rows.BOUNDS, *a.dispatches, SERIAL])}
    print(bench_report.table(sorted(rows, key=lambda r: (r.context, r.p, order.get(r.system, 99)))))
    if a.workload == "reasoning":
        print(bench_workloads.breakdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
