"""Two-model token routing at real shapes on one GPU: naive dispatch vs tokencache cursors.

Run on a CUDA machine (no network needed):  python benches/gpu/routing_step.py
    --large qwen3-32b   a 32B-shaped large model instead of 8B (checks free memory first)
    --smoke             the same code path on CPU with tiny configs, in a few seconds
Prints a markdown table; writes routing_step.json (routing_step_<large>.json for another
--large) into $OUT when that is set, rewritten after every row, so a run cut short by a timeout
still leaves its rows.

Small model: Qwen3-0.6B shape; large: Qwen3-8B shape; random bf16 weights. A Bernoulli router
escalates each token with probability p. Every request's prompt is a shared prefix plus its own
tokens; before each timed run both models' trees are primed with the prompts (so the timed run is
decode: one prompt token plus --max-new generated tokens per request, at ~2048 tokens of
context). Columns: decode tokens/s measured on this GPU (the two models take turns on it),
tokens/s modelled on two devices (per step, the small and large forwards overlap unless there is
a barrier; engine clock="measured"), bookkeeping share (time in tokencache calls over that plus
forward time; forwards are synchronised so their times are GPU times), the small model's idle
share (modelled), mean catch-up batch size, and the small-alone / large-alone bounds.
Dispatches: naive (SGLang-style insert/match around each hand-off, synchronous barrier),
tokencache (cursors, delayed batching of catch-ups), threaded (RoutedEngine(mode="threaded"),
when the engine has it; otherwise the rows say why they were skipped). For threaded rows
both clocks are wall time: the two worker threads really overlap (on one GPU, as far as
their kernels' streams allow).
"""

from __future__ import annotations

import argparse
import gc
import inspect
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

from tokencache_models import PRESETS, CausalLM, ModelConfig, random_model  # noqa: E402
from tokencache_routing import BernoulliRouter, RoutedEngine, ScriptedRouter  # noqa: E402
from tokencache_routing.scheduler import SchedulerConfig  # noqa: E402

SYSTEMS_BOUNDS = ("small alone", "large alone")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", default="qwen3-0.6b", choices=sorted(PRESETS))
    p.add_argument("--large", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--rates", default="0.05,0.1,0.2", help="router escalation probabilities")
    p.add_argument("--batch-sizes", default="8,32,64")
    p.add_argument("--dispatches", default="naive,tokencache,threaded")
    p.add_argument("--shared-prompt", type=int, default=1920, help="tokens shared by all prompts")
    p.add_argument("--unique-prompt", type=int, default=64, help="each request's own tokens")
    p.add_argument("--max-new", type=int, default=64, help="generated tokens per request")
    p.add_argument("--min-large-batch", type=int, default=4)
    p.add_argument("--max-wait", type=int, default=2, help="max catch-up wait in small steps")
    p.add_argument("--backend", default="auto", help="attention backend: auto, torch, triton")
    p.add_argument("--budget-s", type=float, default=100.0, help="stop starting new runs after")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny configs on CPU (checks the script)")
    a = p.parse_args(argv)
    if a.smoke:  # tiny everything; explicit flags still win
        given = set(argv if argv is not None else sys.argv[1:])
        smoke = {
            "--rates": "0.2",
            "--batch-sizes": "2,4",
            "--shared-prompt": 24,
            "--unique-prompt": 4,
            "--max-new": 6,
            "--min-large-batch": 2,
            "--backend": "torch",
            "--budget-s": 60.0,
        }
        for flag, value in smoke.items():
            if flag not in given:
                setattr(a, flag[2:].replace("-", "_"), value)
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


def weight_bytes(c: ModelConfig, itemsize: int) -> int:
    """Parameter bytes of a config, counted from its shapes (norms ignored)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = 2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return itemsize * (c.num_hidden_layers * layer + c.vocab_size * c.hidden_size + head)


def threaded_supported() -> str | None:
    """None when RoutedEngine takes mode="threaded"; else why the threaded rows are skipped."""
    params = inspect.signature(RoutedEngine.__init__).parameters
    if "mode" not in params:
        return "RoutedEngine has no mode= parameter (threaded mode not in this checkout)"
    return None


def make_prompts(n: int, shared: int, unique: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [base + torch.randint(0, vocab, (unique,), generator=g).tolist() for _ in range(n)]


def build_engine(
    system: str, small: CausalLM, large: CausalLM, p: float, b: int, slots: int, args: Any
) -> RoutedEngine:
    common: dict[str, Any] = {"num_slots": slots, "clock": "measured"}
    if system in SYSTEMS_BOUNDS:  # one model; the other side is never used (one-slot pool)
        model = small if system == "small alone" else large
        return RoutedEngine(
            model,
            model,
            ScriptedRouter(),
            large_num_slots=slots,
            scheduler=SchedulerConfig(b),
            **common,
        )
    sched = SchedulerConfig(b, args.min_large_batch, args.max_wait)
    router = BernoulliRouter(p, seed=args.seed)
    if system == "threaded":
        common.update(dispatch="tokencache", mode="threaded")
    else:
        common["dispatch"] = system
    return RoutedEngine(small, large, router, large_num_slots=slots, scheduler=sched, **common)


def prime(eng: RoutedEngine, prompts: list[list[int]], shared: int, both: bool) -> None:
    """Caches the prompts in the trees (both models' when `both`), so the timed run decodes."""
    saved = eng.router
    eng.router = BernoulliRouter(1.0) if both else ScriptedRouter()  # escalate every token
    try:
        eng.generate([prompts[0][: shared + 1]], 1)  # the shared prefix, computed once
        eng.generate(prompts, 1)  # then each request's own tokens on top of it
    finally:
        eng.router = saved


def run_row(
    system: str,
    p: float,
    b: int,
    small: CausalLM,
    large: CausalLM,
    prompts: list[list[int]],
    args: Any,
) -> dict[str, Any]:
    slots = args.shared_prompt + 2 * b * (args.unique_prompt + args.max_new + 1) + 1024
    eng = build_engine(system, small, large, p, b, slots, args)
    try:
        prime(eng, prompts, args.shared_prompt, both=system not in SYSTEMS_BOUNDS)
        st = eng.generate(prompts, args.max_new).stats
        sizes = st.catchup_batch_sizes
        return {
            "tokens": st.tokens,
            "wall_s": st.wall_s,
            "tokens_per_s": st.tokens_per_s,
            "modeled_tokens_per_s": st.modeled_tokens_per_s,
            "bookkeeping_share": st.bookkeeping_share,
            "small_idle_share": st.small_idle_share,
            "mean_catchup_batch": statistics.mean(sizes) if sizes else None,
            "max_catchup_batch": max(sizes) if sizes else None,
            "catchups": len(sizes),
            "escalations": st.escalations,
            "large_prefill_per_escalation": (
                sum(st.catchup_tokens) / st.escalations if st.escalations else None
            ),
            "preemptions": st.preemptions,
            "steps": st.steps,
            "small_forward_s": st.small_forward_s,
            "large_forward_s": st.large_forward_s,
            "bookkeeping_s": st.bookkeeping_s,
            "idle_invariant": eng.idle_invariant(),
        }
    finally:
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def fmt(v: Any, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if v is None else f"{v * scale:{spec}}{suffix}"


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n## {title}\n")
    print(
        "| system | p | batch | tok/s (this device) | tok/s (2 devices, modelled) "
        "| bookkeeping share | small idle share | mean catch-up batch "
        "| large prefill tok/escalation | preemptions |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p = "-" if r["system"] in SYSTEMS_BOUNDS else f"{r['p']:.2f}"
        head = f"| {r['system']} | {p} | {r['batch']} |"
        if "tokens_per_s" not in r:
            why = r.get("skipped") or r.get("error", "?")
            print(f"{head} {why[:60]} | - | - | - | - | - | - |")
            continue
        print(
            f"{head} {r['tokens_per_s']:.0f} | {r['modeled_tokens_per_s']:.0f} | "
            f"{fmt(r['bookkeeping_share'], '.2f', 100, '%')} | "
            f"{fmt(r['small_idle_share'], '.1f', 100, '%')} | "
            f"{fmt(r['mean_catchup_batch'], '.1f')} | "
            f"{fmt(r['large_prefill_per_escalation'], '.1f')} | {r['preemptions']} |"
        )


def print_speedups(rows: list[dict[str, Any]]) -> None:
    done = {(r["system"], r["p"], r["batch"]): r for r in rows if "tokens_per_s" in r}
    lines = []
    for (system, p, b), r in done.items():
        base = done.get(("naive", p, b))
        if system in ("tokencache", "threaded") and base:
            wall = r["tokens_per_s"] / base["tokens_per_s"]
            model = r["modeled_tokens_per_s"] / base["modeled_tokens_per_s"]
            lines.append(f"| {system} | {p:.2f} | {b} | {wall:.2f}x | {model:.2f}x |")
    if lines:
        print("\n### Over naive\n")
        print(
            "| system | p | batch | this device | 2 devices, modelled |\n|---|---:|---:|---:|---:|"
        )
        print("\n".join(lines))


def write_json(result: dict[str, Any]) -> None:
    """$OUT/routing_step.json (routing_step_<large>.json for a non-default large model)."""
    out_dir = os.environ.get("OUT")
    if out_dir:
        large = result["large"]
        name = "routing_step" + ("" if result["smoke"] or large == "qwen3-8b" else f"_{large}")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{name}.json").write_text(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "routing_step.py: no CUDA device found; this benchmark needs a GPU "
            "(--smoke runs the same code on CPU with tiny models).",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)  # tiny matmuls: threads only add overhead
        small_cfg, large_cfg = tiny_qwen3(2, 64), tiny_qwen3(4, 128)
        names = ("tiny-qwen3-small", "tiny-qwen3-large")
        device_name = "cpu (smoke)"
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        small_cfg, large_cfg = PRESETS[args.small], PRESETS[args.large]
        names = (args.small, args.large)
        device_name = torch.cuda.get_device_name()
        if small_cfg.vocab_size != large_cfg.vocab_size:
            print("routing_step.py: the two models must share a vocabulary", file=sys.stderr)
            return 2
        free, total = torch.cuda.mem_get_info()
        need = weight_bytes(small_cfg, 2) + weight_bytes(large_cfg, 2) + (12 << 30)  # + KV, work
        if need > free:
            print(
                f"routing_step.py: {names[0]} + {names[1]} need about {need / 2**30:.0f} GiB "
                f"(weights + 12 GiB for KV and activations); {free / 2**30:.0f} of "
                f"{total / 2**30:.0f} GiB free on {device_name}. Try a smaller --large.",
                file=sys.stderr,
            )
            return 3

    rates = [float(x) for x in args.rates.split(",")]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    dispatches = [d for d in args.dispatches.split(",") if d]
    unknown = set(dispatches) - {"naive", "tokencache", "threaded"}
    if unknown:
        print(f"routing_step.py: unknown dispatch {sorted(unknown)}", file=sys.stderr)
        return 2
    threaded_skip = threaded_supported() if "threaded" in dispatches else None
    if threaded_skip:
        print(f"threaded dispatch skipped: {threaded_skip}", flush=True)

    small = random_model(small_cfg, device, dtype, seed=1, attention_backend=args.backend).eval()
    large = random_model(large_cfg, device, dtype, seed=2, attention_backend=args.backend).eval()
    # Forward times become GPU times (the engine times the call). Only the calling thread's
    # stream is waited for, so a threaded engine's other worker is not serialised by it.
    if device.type == "cuda":
        for m in (small, large):
            m.register_forward_hook(lambda *_: torch.cuda.current_stream().synchronize())
    vocab = small_cfg.vocab_size
    context = args.shared_prompt + args.unique_prompt + args.max_new
    setup = {
        "device": device_name,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "small": names[0],
        "large": names[1],
        "dtype": str(dtype).replace("torch.", ""),
        "backend": args.backend,
        "shared_prompt": args.shared_prompt,
        "unique_prompt": args.unique_prompt,
        "max_new": args.max_new,
        "context": context,
        "min_large_batch": args.min_large_batch,
        "max_wait": args.max_wait,
        "threaded_skipped": threaded_skip,
    }
    print(json.dumps(setup), flush=True)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {**setup, "rows": rows}
    for b in sizes:
        prompts = make_prompts(b, args.shared_prompt, args.unique_prompt, vocab, args.seed)
        jobs = [(s, 0.0) for s in SYSTEMS_BOUNDS] + [(d, p) for p in rates for d in dispatches]
        warmed = False
        for system, p in jobs:
            row: dict[str, Any] = {"system": system, "p": p, "batch": b}
            if system == "threaded" and threaded_skip:
                row["skipped"] = "no threaded mode"
            elif time.monotonic() - t0 > args.budget_s:
                row["skipped"] = "time budget"
            else:
                try:
                    if not warmed:  # first forwards at this batch size pay kernel set-up
                        warm = argparse.Namespace(**{**vars(args), "max_new": 4})
                        run_row("tokencache", max(rates), b, small, large, prompts, warm)
                        warmed = True
                    row.update(run_row(system, p, b, small, large, prompts, args))
                except Exception as e:  # record OOM / engine errors and go on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            result["wall_s"] = time.monotonic() - t0
            write_json(result)

    print_table(
        rows,
        f"Routed decode, small {names[0]} / large {names[1]}, context {context} "
        f"({args.shared_prompt} shared + {args.unique_prompt} own + {args.max_new} new), "
        f"{setup['dtype']}, {device_name}",
    )
    print_speedups(rows)
    if threaded_skip:
        print(f"\nthreaded: skipped ({threaded_skip})")
    result["wall_s"] = time.monotonic() - t0
    write_json(result)
    print(f"\nwall {result['wall_s']:.1f} s")
    failed = [r for r in rows if "error" in r]
    return 1 if failed and len(failed) == sum("skipped" not in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
