"""The decode step end to end through the routing engine, beside the runner's own step.

For each context L: 32 requests behind one shared prompt of L - 16 tokens (16 of their own)
decode on a Qwen3-0.6B-shaped model (random bf16 weights, CUDA graphs; the large model is the
same network, never used: the router never escalates), once with overlapped scheduling
(`EngineConfig(overlap=True)`, the tokencache default: the next small step is prepared and
launched while the device runs the current one) and once without (`overlap=False`, the serial
path). Per row (medians over --steps unless said):
  engine_ms:        RoutedEngine.iterate() end to end as a server runs it: --steps iterations
                    back to back, the device synchronised only before and after the window
                    (mean per step). With overlap the host work should hide behind the device;
  engine_synced_ms: one iteration, synchronised around it and inside (the measured clock's
                    syncs: after each forward and around tree calls): host + device, serially;
  runner_ms:        the runner's own step over the same HostBatch (CausalLM.forward: prepare +
                    replay, synchronised), its deferred input tokens dropped; runner_device_ms:
                    its device work alone (CUDA events around model.execute);
  host_ms:          the engine's host time per small step (Stats.small_host_s: scheduling,
                    preparation, sampling, the router, commits, the trees);
  device_ms:        its device time per small step (Stats.small_device_s, synchronised);
  clock_ms:         the engine clock per step (Stats.modeled_s: device + host serially, about
                    max(host, device) with overlap);
  device_idle_share: Stats.device_idle_s / (idle + device) over the synchronised window: the
                    share of the small model's device time the clock says it waits for the host;
  async_idle_share: 1 - runner_device_ms / engine_ms: about what the device waited for in the
                    back-to-back window (the engine's own device work, sampling and the
                    router's, is a little more than the runner's).
  readback_ms:      per step of the back-to-back window, the time in the router's call and the
                    waits for the drawn tokens and the router's answers (sampling.Readback.get:
                    an event recorded after their copies to pinned memory, so with overlap it
                    waits for this step and not for the one queued after it); readback_ms near
                    runner_device_ms would mean the finishing host work does not hide behind
                    the device.
Target: engine_ms within 1.2x of runner_ms with overlap (`ok`; the serial rows are
there to compare). Then `benches/host_path.py` runs on this machine's CPU (host ms per decode
step at batch 1..256 x 2k..32k, the device work stubbed) if --budget-s leaves time.

    python benches/gpu/engine_step.py                  # on the GPU machine
    python benches/gpu/engine_step.py --smoke          # the same code paths on the CPU, tiny
Writes <device>-<date>-engine.json into $OUT when set, else benches/gpu/results/ (GPU only),
rewritten after every row so a run cut short keeps its rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))
sys.path.insert(0, str(ROOT / "benches"))

import torch  # noqa: E402

from tokencache_models import (  # noqa: E402
    PRESETS,
    CausalLM,
    Epilogue,
    HostBatch,
    ModelConfig,
    random_model,
)
from tokencache_routing import EngineConfig, EntropyRouter, RoutedEngine, SchedulerConfig  # noqa: E402
from tokencache_routing.core.sampling import Readback  # noqa: E402

SMOKE_CONFIG = ModelConfig(
    model_type="qwen3",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
OWN = 16
TARGET = 1.2  # the engine's step within 1.2x of the runner's


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def runner_step(
    model: CausalLM,
    hb: HostBatch,
    pool: Any,
    steps: int,
    device: torch.device,
    epilogue: Epilogue | None = None,
) -> tuple[float, float]:
    """The runner's own step over hb (its deferred input tokens dropped: the placeholders are
    fed) with the engine's epilogue (greedy tokens, entropy): median ms of prepare + execute,
    synchronised, and of the device work alone."""
    hb = dataclasses.replace(hb, deferred=None)
    model.execute(model.prepare(hb, pool, epilogue=epilogue))  # warm (its graph exists)
    wall, dev = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step = model.prepare(hb, pool, epilogue=epilogue)
        if device.type == "cuda":
            e0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e0.record()
            model.execute(step)
            e1.record()
            sync(device)
            wall.append(time.perf_counter() - t0)
            dev.append(e0.elapsed_time(e1) / 1e3)
        else:
            t1 = time.perf_counter()
            model.execute(step)
            t2 = time.perf_counter()
            wall.append(t2 - t0)
            dev.append(t2 - t1)
    return statistics.median(wall) * 1e3, statistics.median(dev) * 1e3


def engine_row(
    model: CausalLM,
    batch: int,
    context: int,
    steps: int,
    device: torch.device,
    overlap: bool,
    runner: tuple[float, float] | None = None,
) -> tuple[dict[str, Any], tuple[float, float]]:
    """One context's figures with overlap on or off (see the module docstring); the runner's
    step is measured here unless given (the same for both settings)."""
    last: list[HostBatch] = []
    epilogues: list[Epilogue | None] = []  # the engine's: the runner's step computes it too
    prepare = model.prepare

    def recording(hb: Any, pool: Any, backend: Any = None, epilogue: Any = None) -> Any:
        if isinstance(hb, HostBatch) and hb.num_real == batch:
            last[:] = [hb]
            epilogues[:] = [epilogue]
        return prepare(hb, pool, backend, epilogue)

    model.prepare = recording  # type: ignore[method-assign,assignment]
    try:
        eng = RoutedEngine(
            model,
            model,
            EntropyRouter(math.inf),
            config=EngineConfig(
                num_slots=context + batch * (OWN + 2 * steps + 48) + 64,
                scheduler=SchedulerConfig(max_running=batch),
                clock="measured",
                overlap=overlap,
            ),
        )
        # Made with the engine (ModelExecutor.prepare_runner), not in a first step: 1 on CUDA.
        runners_at_start = len(model.executor.runners(eng.small.pool))
        g = torch.Generator().manual_seed(context)
        vocab = model.config.vocab_size
        shared = torch.randint(0, vocab, (context - OWN,), generator=g).tolist()
        own = torch.randint(0, vocab, (batch, OWN), generator=g).tolist()
        handles = [eng.submit(shared + o, 2 * steps + 40) for o in own]  # none ends
        while any(len(h.tokens) < 4 for h in handles):  # prefills, graph captures, warm-up
            eng.iterate()
            failed = [h for h in handles if h.done()]  # none ends: one that did, failed
            if failed:
                raise RuntimeError(f"a request ended in the warm-up: {failed[0].error!r}")
        st = eng.stats
        # The synchronised window: the measured clock's own accounting, step by step.
        start = st.copy()
        synced = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            eng.iterate()
            sync(device)
            synced.append(time.perf_counter() - t0)
        win = st.since(start)
        per_step: Callable[[float], float] = lambda s: 1e3 * s / max(1, win.steps)  # noqa: E731
        # Back to back, as a server drives it: no synchronisation but the engine's own (the
        # sides' clock syncs off, as with clock="steps"), the device synchronised at the ends.
        sides = eng.sides
        syncs = [s.sync_cuda for s in sides]
        for s in sides:
            s.sync_cuda = False
        before = st.copy()
        readback = [0.0]  # time the host waits reading drawn tokens and answers back
        get = Readback.get

        def timed_get(self: Readback) -> Any:
            t = time.perf_counter()
            try:
                return get(self)
            finally:
                readback[0] += time.perf_counter() - t

        Readback.get = timed_get  # type: ignore[method-assign]
        try:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.iterate()
            sync(device)
            window = time.perf_counter() - t0
        finally:
            Readback.get = get  # type: ignore[method-assign]
        async_steps = st.since(before).steps
        for s, v in zip(sides, syncs, strict=True):
            s.sync_cuda = v
        both = st.since(start)
        if runner is None:
            runner = runner_step(model, last[0], eng.small.pool, steps, device, epilogues[0])
        eng.shutdown()
    finally:
        model.prepare = prepare  # type: ignore[method-assign]
    sizes = both.small_batch_sizes
    e = 1e3 * window / max(1, async_steps)
    r, r_dev = runner
    idle, busy = win.device_idle_s, win.small_device_s
    row = {
        "check": "engine step",
        "batch": batch,
        "context": context,
        "overlap": overlap,
        "engine_ms": e,
        "engine_synced_ms": statistics.median(synced) * 1e3,
        "runner_ms": r,
        "runner_device_ms": r_dev,
        "ratio": e / r,
        "host_ms": per_step(win.small_host_s),
        "device_ms": per_step(busy),
        "clock_ms": per_step(win.modeled_s),
        "device_idle_share": idle / (idle + busy) if idle + busy > 0 else 0.0,
        "async_idle_share": max(0.0, 1.0 - r_dev / e) if e > 0 else 0.0,
        "readback_ms": 1e3 * readback[0] / max(1, async_steps),
        "steps": [win.steps, async_steps],
        "dropped_rows": both.dropped_rows,
        # every timed step a full decode batch, nothing escalated: the rows mean what they say
        "clean": bool(sizes) and all(b == batch for b in sizes) and both.escalations == 0,
        "runners_at_start": runners_at_start,
        "target": overlap,
        "ok": e / r <= TARGET,
    }
    return row, runner


def write(result: dict[str, Any], device: torch.device, args: argparse.Namespace) -> Path | None:
    """The JSON file: $OUT (what comes back from the device machine), else
    benches/gpu/results/ (--out: a file or a directory); GPU runs only unless --out."""
    out = Path(args.out) if args.out else None
    if out is None and device.type == "cuda":
        out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benches/gpu/results"
    if out is None:
        return None
    if out.suffix != ".json":
        slug = re.sub(r"[^a-z0-9]+", "-", str(result["device"]).lower()).strip("-")
        out = out / f"{slug}-{datetime.date.today().isoformat()}-engine.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| L | batch | overlap | engine ms | x runner | synced ms | runner ms | runner device ms "
        "| host ms | device ms | clock ms | device idle (clock) | device idle (async) "
        "| read-back ms | ok |\n"
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    out = [head]
    for r in rows:
        if "engine_ms" not in r:
            why = r.get("skipped", r.get("error"))
            out.append(f"| {r['context']} | {r['batch']} | {r['overlap']} | {why} |")
            continue
        out.append(
            f"| {r['context']} | {r['batch']} | {'on' if r['overlap'] else 'off'} "
            f"| {r['engine_ms']:.3f} | {r['ratio']:.2f}x | {r['engine_synced_ms']:.3f} "
            f"| {r['runner_ms']:.3f} | {r['runner_device_ms']:.3f} | {r['host_ms']:.3f} "
            f"| {r['device_ms']:.3f} | {r['clock_ms']:.3f} | {100 * r['device_idle_share']:.0f}% "
            f"| {100 * r['async_idle_share']:.0f}% | {r['readback_ms']:.3f} "
            f"| {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--overlap",
        choices=("both", "on", "off"),
        default="both",
        help="overlapped scheduling on, off, or both (on first: the target)",
    )
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no row after this")
    ap.add_argument("--host-path", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--host-path-quick",
        action="store_true",
        help="host_path.py at batch 32, 256 x 2048, 8192 only (seconds, not a minute)",
    )
    ap.add_argument("--out", default=None, help="JSON file or directory (default: $OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few steps")
    args = ap.parse_args(argv)
    if args.smoke:
        device, dtype, config = torch.device("cpu"), torch.float32, SMOKE_CONFIG
        args.batch, args.contexts, args.steps = 3, [40], 3
    elif not torch.cuda.is_available():
        print("engine_step.py: no CUDA device found (--smoke runs on the CPU)", file=sys.stderr)
        return 2
    else:
        device, dtype, config = torch.device("cuda"), torch.bfloat16, PRESETS[args.model]
    t0 = time.monotonic()
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-smoke"
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "device": dev,
        "torch": torch.__version__,
        "model": args.model if not args.smoke else "smoke",
        "target": f"engine_ms <= {TARGET} x runner_ms with overlap",
        "engine": rows,
        "host_path": [],
    }
    model = random_model(config, device=device, dtype=dtype, seed=0)
    settings = {"both": [True, False], "on": [True], "off": [False]}[args.overlap]
    for c in args.contexts:
        runner: tuple[float, float] | None = None
        for overlap in settings:
            if time.monotonic() - t0 > args.budget_s:
                row: dict[str, Any] = {"context": c, "batch": args.batch, "overlap": overlap}
                row["skipped"] = "time budget"
            else:
                try:
                    row, runner = engine_row(
                        model, args.batch, c, args.steps, device, overlap, runner
                    )
                except Exception as e:  # a row that fails says why; the others still run
                    row = {"context": c, "batch": args.batch, "overlap": overlap}
                    row["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            result["wall_s"] = time.monotonic() - t0
            write(result, device, args)
            gc.collect()  # model <-> graph runner cycles hold the pool and the graphs' memory
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n" + markdown(rows) + "\n", flush=True)
    left = args.budget_s - (time.monotonic() - t0)
    if args.host_path and (args.smoke or left > 20):
        import host_path

        if args.smoke:
            cli = ["--steps", "3", "--batches", "1", "3", "--contexts", "40"]
        elif args.host_path_quick:
            cli = ["--steps", "10", "--batches", "32", "256", "--contexts", "2048", "8192"]
        else:
            cli = ["--steps", "10"]
        result["host_path"] = [vars(r) for r in host_path.main(cli)]
    elif args.host_path:
        print(f"host path not run: {left:.0f} s of the budget left")
    result["wall_s"] = time.monotonic() - t0
    path = write(result, device, args)
    if path is not None:
        print(f"wrote {path}")
    measured = [r for r in rows if "engine_ms" in r]
    failed = [r for r in rows if "error" in r or ("ok" in r and r["target"] and not r["ok"])]
    return 0 if args.smoke or (measured and not failed) else 1


if __name__ == "__main__":
    sys.exit(main())
