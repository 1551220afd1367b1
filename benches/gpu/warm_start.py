"""A server's start on a GPU: how long RoutedEngine.warm_up takes, what it holds, and whether
the first request after it is as fast as a repeated one.

    python benches/gpu/warm_start.py            # on the GPU machine (Qwen3-0.6B + Qwen3-8B)
    python benches/gpu/warm_start.py --smoke    # the same code paths on the CPU, tiny models

Random bf16 weights. Rows, in order:
  warm-up (first):  RoutedEngine.warm_up on a fresh engine, Triton's compile cache as found
                    (cold on a fresh machine): seconds, graph keys, device memory it reserved;
  warm-up (again):  the same on a second engine over the same models (their kernels compiled
                    by now, as after a restart with a warm Triton cache: what a restart costs);
  requests:         TTFT of the first request after the warm-up and of repeats (other prompts
                    of the same shape), and the runners' cold runs (forwards outside the warmed
                    keys: a capture or compile while serving; 0 expected);
  cold engine:      the same first request on an engine that was not warmed up (what warm-up
                    saves the first user).
Targets: warm-up of the pair under 60 s with a warm Triton cache; the first request's TTFT
within 2x a repeated one's after warm-up; no cold run. Writes $OUT/warm_start.json (GPU only,
or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))

import torch  # noqa: E402

from tokencache_models import PRESETS, CausalLM, random_model  # noqa: E402
from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine, SchedulerConfig  # noqa: E402

SMOKE_CONFIG = dataclasses.replace(
    PRESETS["qwen3-0.6b"],
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", default="qwen3-0.6b", choices=sorted(PRESETS))
    p.add_argument("--large", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--num-slots", type=int, default=65536)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of each request")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="requests after the first")
    p.add_argument("--p", type=float, default=0.1, help="escalation rate (Bernoulli router)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/warm_start.json)")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    return p.parse_args(argv)


def build(a: argparse.Namespace) -> tuple[CausalLM, CausalLM]:
    if a.smoke:
        small = random_model(SMOKE_CONFIG, seed=1, attention_backend="torch")
        large = random_model(dataclasses.replace(SMOKE_CONFIG, num_hidden_layers=3), seed=2)
        for model in (small, large):  # the runners' static paths: what graphs replay on CUDA
            ex = model.executor
            ex.decode_padding = ex.decode_runner = ex.extend_runner = True
        return small, large
    small = random_model(PRESETS[a.small], "cuda", torch.bfloat16, seed=1)
    large = random_model(PRESETS[a.large], "cuda", torch.bfloat16, seed=2)
    return small, large


def engine(models: tuple[CausalLM, CausalLM], a: argparse.Namespace) -> RoutedEngine:
    # Smoke: small limits, so that the CPU's width-keyed torch graphs stay few.
    sched = SchedulerConfig(max_running=4, max_parked=4, chunked_prefill_size=64)
    sched = sched if a.smoke else None
    router = BernoulliRouter(a.p, seed=0)
    return RoutedEngine(
        *models, router, config=EngineConfig(num_slots=a.num_slots, scheduler=sched, mode="events")
    )


def ttft(eng: RoutedEngine, prompt: list[int], max_new: int, key: int) -> float:
    """Seconds from submission to the first token of one request (the event loop driven here,
    the device synchronised by the measured clock)."""
    t0 = time.perf_counter()
    h = eng.submit(prompt, max_new, route_key=key)
    while not h.tokens and eng.iterate():
        pass
    first = time.perf_counter() - t0
    while eng.iterate():
        pass
    h.wait()
    return first


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def release(eng: RoutedEngine) -> None:
    eng.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.smoke:
        a.num_slots, a.prompt, a.max_new, a.repeats = 256, 24, 8, 2
    elif not torch.cuda.is_available():
        print("warm_start.py needs a CUDA device (use --smoke on the CPU)", file=sys.stderr)
        return 2
    models = build(a)
    vocab = models[0].config.vocab_size
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    for label in ("first", "again"):
        eng = engine(models, a)
        made = eng.warm_up(progress=not a.smoke)
        row = {"check": f"warm-up ({label})", "seconds": made.seconds, "keys": made.keys}
        emit(row | {"memory_gib": made.memory_bytes / 2**30})
        if label == "again":
            times = [
                ttft(eng, q, a.max_new, i)
                for i, q in enumerate(prompts(1 + a.repeats, a.prompt, vocab, seed=7))
            ]
            repeat = statistics.median(times[1:])
            emit(
                {
                    "check": "requests after warm-up",
                    "ttft_first_ms": 1e3 * times[0],
                    "ttft_repeat_ms": 1e3 * repeat,
                    "first_over_repeat": times[0] / repeat,
                    "cold_runs": eng.cold_runs(),
                    "ok": times[0] <= 2 * repeat and eng.cold_runs() == 0,
                }
            )
        release(eng)
    eng = engine(models, a)
    cold = ttft(eng, prompts(1, a.prompt, vocab, seed=8)[0], a.max_new, 0)
    emit({"check": "cold engine, first request", "ttft_ms": 1e3 * cold})
    release(eng)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    result = {"device": device, "torch": torch.__version__, "smoke": a.smoke, "rows": rows}
    out = Path(a.out) if a.out else None
    if out is None and os.environ.get("OUT") and not a.smoke:
        out = Path(os.environ["OUT"]) / "warm_start.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
