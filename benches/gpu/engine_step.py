"""The decode step end to end through the routing engine, beside the runner's own step (issue 20).

For each context L: 32 requests behind one shared prompt of L - 16 tokens (16 of their own)
decode on a Qwen3-0.6B-shaped model (random bf16 weights; the large model is the same network,
never used: the router never escalates). Three figures per step, medians over --steps:
  engine_ms: RoutedEngine.iterate() wall time, synchronised (the scheduler, the slot table,
             the runner's preparation and its CUDA-graph replay, sampling, the router, commits);
  runner_ms: the runner's own step over the same HostBatch (CausalLM.forward: prepare + replay);
  host_ms:   the engine's own host-time accounting per small step (Stats.small_host_s).
Target: engine_ms within 1.2x of runner_ms. Then `benches/host_path.py` runs on this
machine's CPU (host ms per decode step at batch 1..256 x 2k..32k, the device work stubbed).

    python benches/gpu/engine_step.py                  # on the GPU machine
    python benches/gpu/engine_step.py --smoke          # the same code paths on the CPU, tiny
Writes <device>-<date>-engine.json into $OUT when set, else benches/gpu/results/ (GPU only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))
sys.path.insert(0, str(ROOT / "benches"))

import torch  # noqa: E402

from tokencache_models import PRESETS, CausalLM, HostBatch, ModelConfig, random_model  # noqa: E402
from tokencache_routing import EntropyRouter, RoutedEngine, SchedulerConfig  # noqa: E402

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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_row(
    model: CausalLM, batch: int, context: int, steps: int, device: torch.device
) -> dict[str, Any]:
    """One context's three figures (see the module docstring)."""
    last: list[HostBatch] = []
    prepare = model.prepare

    def recording(hb: Any, pool: Any, backend: Any = None) -> Any:
        if isinstance(hb, HostBatch):
            last[:] = [hb]
        return prepare(hb, pool, backend)

    model.prepare = recording  # type: ignore[method-assign]
    try:
        eng = RoutedEngine(
            model,
            model,
            EntropyRouter(math.inf),
            num_slots=context + batch * (OWN + steps + 16) + 64,
            scheduler=SchedulerConfig(max_running=batch),
            clock="measured",
        )
        g = torch.Generator().manual_seed(context)
        vocab = model.config.vocab_size
        shared = torch.randint(0, vocab, (context - OWN,), generator=g).tolist()
        own = torch.randint(0, vocab, (batch, OWN), generator=g).tolist()
        handles = [eng.submit(shared + o, steps + 12) for o in own]
        while any(len(h.tokens) < 4 for h in handles):  # prefills, graph captures, warm-up
            eng.iterate()
        st = eng.stats
        wall, host = [], []
        for _ in range(steps):
            h0, n0 = st.small_host_s, len(st.small_batch_sizes)
            sync(device)
            t0 = time.perf_counter()
            eng.iterate()
            sync(device)
            if len(st.small_batch_sizes) == n0 + 1 and st.small_batch_sizes[-1] == batch:
                wall.append(time.perf_counter() - t0)
                host.append(st.small_host_s - h0)
        hb = last[0]
        pool = eng.small.pool
        runner = []
        for _ in range(steps):  # the same step again through the runner alone (same slots)
            sync(device)
            t0 = time.perf_counter()
            model.forward(hb, pool)
            sync(device)
            runner.append(time.perf_counter() - t0)
        eng.shutdown()
    finally:
        model.prepare = prepare  # type: ignore[method-assign]
    e, r = statistics.median(wall) * 1e3, statistics.median(runner) * 1e3
    return {
        "check": "engine step",
        "batch": batch,
        "context": context,
        "engine_ms": e,
        "runner_ms": r,
        "ratio": e / r,
        "host_ms": statistics.median(host) * 1e3,
        "ok": e / r <= 1.2,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--host-path", action=argparse.BooleanOptionalAction, default=True)
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
    model = random_model(config, device=device, dtype=dtype, seed=0)
    rows = []
    for c in args.contexts:
        row = engine_row(model, args.batch, c, args.steps, device)
        print(json.dumps(row), flush=True)
        rows.append(row)
    host_rows: list[dict[str, Any]] = []
    if args.host_path:
        import host_path

        cli = (
            ["--steps", "3", "--batches", "1", "3", "--contexts", "40"]
            if args.smoke
            else ["--steps", "10"]
        )
        host_rows = [vars(r) for r in host_path.main(cli)]
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-smoke"
    result = {"device": dev, "torch": torch.__version__, "engine": rows, "host_path": host_rows}
    result["wall_s"] = time.monotonic() - t0
    if device.type == "cuda":
        out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benches/gpu/results"
        slug = re.sub(r"[^a-z0-9]+", "-", dev.lower()).strip("-")
        path = out / f"{slug}-{datetime.date.today().isoformat()}-engine.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
