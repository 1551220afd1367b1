"""Routed decode benchmark: naive dispatchers vs tokencache cursors, in one harness.

    python -m tokencache_routing.bench [--quick] [--plot routing_bench.png]
        [--dispatches naive naive-sglang tokencache threaded] [--no-alone]
    python -m tokencache_routing.bench --shared-prompt 2000 --max-new 48 --batches 8 32 \
        --rates 0.1 --no-alone   # long context

Dispatches: "naive" (re-admission through tokencache's RadixTree), "naive-sglang" (the same
through SGLang's own RadixCache; needs sglang importable), "tokencache" (cursors, event loop),
"threaded" (cursors, one worker thread per model).

Tiny random models on CPU by default. For each routing rate p and batch size it reports decode
tokens/s measured on this machine (the event loop runs the two models in turn on one CPU;
"tokencache (threaded)" runs one worker thread per model, so on two or more cores they really
overlap), tokens/s modelled on two devices for the event loop (per step: small and large
forwards overlap without a barrier, add up with one; "-" for the threaded mode, which is measured),
the bookkeeping share (time in tokencache calls, or SGLang RadixCache calls for naive-sglang,
over time in calls plus forwards) and bookkeeping microseconds per decoded token, the small
model's idle share (modelled), catch-up batch sizes and tokens the large model prefills per
escalation. The small model alone and the large model alone are the bounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokencache_models import CausalLM, ModelConfig, random_model

from .engine import RoutedEngine, Stats
from .routers import BernoulliRouter, Router, ScriptedRouter
from .scheduler import SchedulerConfig


def tiny_config(layers: int, hidden: int, max_positions: int = 4096) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
    )


@dataclass
class Row:
    system: str
    p: float
    batch: int
    stats: Stats


def make_prompts(n: int, shared: int, unique: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [base + torch.randint(0, vocab, (unique,), generator=g).tolist() for _ in range(n)]


def run_one(
    small: CausalLM,
    large: CausalLM,
    router: Router,
    prompts: list[list[int]],
    max_new: int,
    dispatch: str,
    sched: SchedulerConfig,
    mode: str = "events",
) -> Stats:
    slots = len(prompts) * (len(prompts[0]) + max_new) + 64
    eng = RoutedEngine(
        small,
        large,
        router,
        num_slots=slots,
        dispatch=dispatch,
        scheduler=sched,
        clock="measured",
        mode=mode,
    )
    return eng.generate(prompts, max_new).stats


THREADED = "tokencache (threaded)"
# --dispatches names -> row names; "naive-sglang" drives SGLang's RadixCache (naive_sglang.py).
DISPATCH_SYSTEMS = {
    "naive": "naive",
    "naive-sglang": "naive-sglang",
    "tokencache": "tokencache",
    "threaded": THREADED,
}
SYSTEMS = tuple(DISPATCH_SYSTEMS.values())


def fmt_row(r: Row) -> str:
    s = r.stats
    sizes = s.catchup_batch_sizes
    mean_b = f"{statistics.mean(sizes):.1f}" if sizes else "-"
    per_esc = f"{sum(s.catchup_tokens) / s.escalations:.1f}" if s.escalations else "-"
    p = "-" if r.system.endswith("alone") else f"{r.p:.2f}"
    modeled = "-" if r.system == THREADED else f"{s.modeled_tokens_per_s:.0f}"
    per_tok = f"{1e6 * s.bookkeeping_s / s.tokens:.1f}" if s.tokens else "-"
    return (
        f"| {r.system} | {p} | {r.batch} | {s.tokens_per_s:.0f} | {modeled} | "
        f"{100 * s.bookkeeping_share:.2f}% | {per_tok} | {100 * s.small_idle_share:.1f}% | "
        f"{mean_b} | "
        f"{max(sizes) if sizes else '-'} | {per_esc} | {s.preemptions} |"
    )


HEADER = (
    "| system | p | batch | tok/s (this CPU) | tok/s (2 devices, modelled) | bookkeeping share | "
    "bookkeeping us/token | small idle share | mean catch-up batch | max catch-up batch | "
    "large prefill tok/escalation "
    "| preemptions |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def plot(rows: Sequence[Row], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batches = sorted({r.batch for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        for system in [s for s in SYSTEMS if any(r.system == s for r in rows)]:
            pts = sorted(  # the threaded mode is measured for real, the event loop modelled
                (r.p, r.stats.tokens_per_s if system == THREADED else r.stats.modeled_tokens_per_s)
                for r in rows
                if r.batch == b and r.system == system
            )
            label = f"{system}, measured" if system == THREADED else system
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        for r in rows:
            if r.batch == b and r.system.endswith("alone"):
                ax.axhline(
                    r.stats.modeled_tokens_per_s,
                    ls="--",
                    lw=1,
                    label=r.system,
                    color="gray" if r.system.startswith("large") else "green",
                )
        ax.set_title(f"batch {b}")
        ax.set_xlabel("routing rate p")
        ax.set_ylabel("decode tok/s (2 devices)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, under 30 s")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--shared-prompt", type=int, default=256)
    ap.add_argument("--unique-prompt", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--min-large-batch", type=int, default=4)
    ap.add_argument("--max-wait", type=int, default=2, help="max wait in small steps")
    ap.add_argument(
        "--max-wait-ms", type=float, default=2.0, help="threaded mode: max wait in milliseconds"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--plot", default="routing_bench.png", help="PNG path ('' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dispatches",
        nargs="+",
        choices=list(DISPATCH_SYSTEMS),
        default=None,
        help="systems to run (default: all four; --quick leaves out naive-sglang, whose "
        "sglang import alone takes several seconds)",
    )
    ap.add_argument("--no-alone", action="store_true", help="skip the small/large-alone bounds")
    a = ap.parse_args(argv)
    if a.quick:  # explicit size flags still win
        given = set(argv if argv is not None else sys.argv[1:])
        if "--shared-prompt" not in given:
            a.shared_prompt = 32
        if "--unique-prompt" not in given:
            a.unique_prompt = 8
        if "--max-new" not in given:
            a.max_new = 24
    if a.dispatches is None:
        a.dispatches = [d for d in DISPATCH_SYSTEMS if not (a.quick and d == "naive-sglang")]
    if a.threads:
        torch.set_num_threads(a.threads)
    from tqdm import tqdm

    positions = max(4096, a.shared_prompt + a.unique_prompt + a.max_new + 8)
    cfg_small, cfg_large = tiny_config(2, 128, positions), tiny_config(8, 256, positions)
    small = random_model(cfg_small, seed=1, std=0.1, attention_backend="torch").eval()
    large = random_model(cfg_large, seed=2, std=0.1, attention_backend="torch").eval()
    vocab = small.config.vocab_size
    never = ScriptedRouter()
    jobs: list[tuple[str, float, int]] = []
    systems = [DISPATCH_SYSTEMS[d] for d in dict.fromkeys(a.dispatches)]
    for b in a.batches:
        if not a.no_alone:
            jobs += [("small alone", 0.0, b), ("large alone", 0.0, b)]
        jobs += [(d, p, b) for p in a.rates for d in systems]
    # Warm-up: the first forwards pay one-off allocator and kernel set-up costs (and the
    # naive-sglang dispatch imports sglang).
    warm = make_prompts(2, 8, 4, vocab)
    warmups = [("tokencache", "events"), ("tokencache", "threaded")]
    if "naive-sglang" in systems:
        warmups.append(("naive-sglang", "events"))
    for dispatch, mode in warmups:
        run_one(small, large, BernoulliRouter(0.2), warm, 4, dispatch, SchedulerConfig(), mode)
    rows: list[Row] = []
    for system, p, b in tqdm(jobs, desc="routing bench", file=sys.stderr):
        prompts = make_prompts(b, a.shared_prompt, a.unique_prompt, vocab, a.seed)
        if system == "small alone":
            st = run_one(small, small, never, prompts, a.max_new, "tokencache", SchedulerConfig(b))
        elif system == "large alone":
            st = run_one(large, large, never, prompts, a.max_new, "tokencache", SchedulerConfig(b))
        else:
            sched = SchedulerConfig(
                b, a.min_large_batch, a.max_wait, max_wait_s=a.max_wait_ms / 1e3
            )
            router = BernoulliRouter(p, seed=a.seed)
            mode = "threaded" if system == THREADED else "events"
            dispatch = "tokencache" if system == THREADED else system
            st = run_one(small, large, router, prompts, a.max_new, dispatch, sched, mode)
        rows.append(Row(system, p, b, st))
    print(
        f"small: {small.config.num_hidden_layers} layers x {small.config.hidden_size}, large: "
        f"{large.config.num_hidden_layers} layers x {large.config.hidden_size}; prompt "
        f"{a.shared_prompt} shared + {a.unique_prompt} own tokens, {a.max_new} new tokens; "
        f"torch threads {torch.get_num_threads()}\n"
    )
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    if a.plot and plot(rows, a.plot):
        print(f"\nplot: {a.plot}")


if __name__ == "__main__":
    main()
