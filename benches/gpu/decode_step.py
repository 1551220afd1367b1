"""Decode step time vs batch size for Qwen3 shapes with random bf16 weights, both attention paths.

Run on a CUDA machine (no network needed):  python benches/gpu/decode_step.py
Prints a markdown table; writes decode_step.json into $OUT when that is set.
Every request attends over `--context` cached tokens (random K/V in shuffled slots); each timed
step decodes one token per request and rewrites the same slot, so the context stays constant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))  # runs from a checkout without installing

from tokencache_models import PRESETS, ForwardBatch, KVPool, random_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--backends", default="torch,triton")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new runs after")
    return p.parse_args()


def make_batch(bs: int, context: int, perm: torch.Tensor, vocab: int) -> ForwardBatch:
    """bs decode requests; request r owns perm[r*context:(r+1)*context], the last one new."""
    slots = perm[: bs * context].view(bs, context)
    return ForwardBatch(
        token_ids=torch.randint(0, vocab, (bs,), dtype=torch.int64),
        positions=torch.full((bs,), context - 1, dtype=torch.int64),
        out_slots=slots[:, -1].contiguous(),
        q_offsets=torch.arange(bs + 1, dtype=torch.int64),
        kv_slots=slots.reshape(-1).contiguous(),
        kv_offsets=torch.arange(bs + 1, dtype=torch.int64) * context,
    )


def time_steps(model: Any, batch: ForwardBatch, pool: KVPool, backend: str, args: Any) -> float:
    for _ in range(args.warmup):
        model(batch, pool, backend)
    torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(batch, pool, backend)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("decode_step.py: no CUDA device found; this benchmark needs a GPU.", file=sys.stderr)
        return 2
    args = parse_args()
    t0 = time.monotonic()
    device = torch.device("cuda")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    backends = args.backends.split(",")
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for name in args.models.split(","):
        config = PRESETS[name]
        torch.manual_seed(0)
        model = random_model(config, device, torch.bfloat16, seed=0)
        pool = KVPool.for_config(config, max(sizes) * args.context, device, torch.bfloat16)
        pool.k.normal_()
        pool.v.normal_()
        perm = torch.randperm(pool.num_slots)  # scattered slots, as a paged cache would be
        # Cross-check the two attention paths once per model on a small batch.
        cb = make_batch(min(8, max(sizes)), args.context, perm, config.vocab_size).to(device)
        ref = model(cb, pool, "torch")
        tri = model(cb, pool, "triton")
        checks.append(
            {
                "model": name,
                "max_abs_logit_diff": (ref.logits - tri.logits).abs().max().item(),
                "argmax_equal": bool(torch.equal(ref.logits.argmax(-1), tri.logits.argmax(-1))),
            }
        )
        for bs in sizes:
            batch = make_batch(bs, args.context, perm, config.vocab_size).to(device)
            for backend in backends:
                row: dict[str, Any] = {"model": name, "backend": backend, "batch": bs}
                if time.monotonic() - t0 > args.budget_s:
                    row["skipped"] = "time budget"
                else:
                    try:
                        ms = time_steps(model, batch, pool, backend, args)
                        row.update(step_ms=ms, tokens_per_s=bs / ms * 1e3)
                    except Exception as e:  # record OOM / compile errors and go on
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                        torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
        del model, pool
        torch.cuda.empty_cache()

    print(f"\n## Decode step, context {args.context}, bf16, {torch.cuda.get_device_name()}\n")
    print("| model | backend | batch | step ms | tokens/s |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        if "step_ms" in r:
            ms, tps = f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.0f}"
        else:
            ms, tps = r.get("skipped") or r.get("error", "?")[:40], "-"
        print(f"| {r['model']} | {r['backend']} | {r['batch']} | {ms} | {tps} |")
    print("\nBackend cross-check (batch 8):", json.dumps(checks))
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "context": args.context,
        "dtype": "bfloat16",
        "rows": rows,
        "checks": checks,
        "wall_s": time.monotonic() - t0,
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "decode_step.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
