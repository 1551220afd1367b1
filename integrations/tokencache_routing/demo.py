"""Routed generation on real text, offline: SmolLM2-135M as the large model, its first layers as
the small one (same tokenizer), an entropy router. Escalated tokens are printed in [brackets].

    python -m tokencache_routing.demo [--layers 24] [--threshold 0.5] [--max-new 20]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import torch

from .engine import GenerateResult, RoutedEngine
from .routers import EntropyRouter
from .scheduler import SchedulerConfig

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give two tips for staying healthy.",
    "Explain what a prime number is.",
    "Name three colours of the rainbow.",
]


def marked(tokenizer: object, tokens: Sequence[int], models: Sequence[int]) -> str:
    """Decoded answer with the large model's tokens in [brackets]."""
    out = []
    for t, m in zip(tokens, models, strict=True):
        piece = tokenizer.decode([t])  # type: ignore[attr-defined]
        out.append(f"[{piece}]" if m else piece)
    return "".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=24, help="layers of the small model")
    ap.add_argument("--threshold", type=float, default=0.5, help="entropy threshold (nats)")
    ap.add_argument("--max-new", type=int, default=20)
    ap.add_argument("--requests", type=int, default=3)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokencache_models import load_smollm2_gguf, truncate_model

    t0 = time.perf_counter()
    g = load_smollm2_gguf(dtype=torch.float32, attention_backend="torch")
    large, tok = g.model, g.tokenizer
    small = truncate_model(large, a.layers)
    print(
        f"loaded SmolLM2-135M ({large.config.num_hidden_layers} layers; small = first "
        f"{a.layers}) in {time.perf_counter() - t0:.1f} s"
    )
    qs = (QUESTIONS * a.requests)[: a.requests]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in qs
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    router = EntropyRouter(a.threshold)
    sched = SchedulerConfig(max_running=len(prompts), min_large_batch=2, max_wait_steps=2)
    results: dict[str, GenerateResult] = {}
    # Warm-up: the first forwards pay one-off set-up costs that would skew the first system.
    RoutedEngine(small, large, router, num_slots=256).generate(prompts[:1], 2)
    for dispatch in ("tokencache", "naive"):
        eng = RoutedEngine(
            small,
            large,
            router,
            num_slots=4096,
            dispatch=dispatch,
            scheduler=sched,
            clock="measured",
            tokenizer=tok,
            eos_token_id=tok.eos_token_id,
        )
        results[dispatch] = eng.generate(prompts, a.max_new)
        assert eng.idle_invariant()
    res = results["tokencache"]
    for q, t, m in zip(qs, res.tokens, res.models, strict=True):
        print(f"\nQ: {q}\nA: {marked(tok, t, m)}")
    n_tok = sum(map(len, res.tokens))
    n_large = sum(map(sum, res.models))
    print(
        f"\n{n_large}/{n_tok} tokens ({100 * n_large / max(n_tok, 1):.0f}%) from the large model "
        f"(entropy >= {a.threshold})"
    )
    for name, r in results.items():
        s = r.stats
        print(
            f"{name:>10}: {s.tokens_per_s:6.1f} tok/s on this CPU, "
            f"{s.modeled_tokens_per_s:6.1f} tok/s modelled on 2 devices, "
            f"bookkeeping {100 * s.bookkeeping_share:.2f}%, small idle "
            f"{100 * s.small_idle_share:.0f}%"
        )
    same = results["naive"].tokens == res.tokens
    print(f"naive dispatcher produced {'the same' if same else 'DIFFERENT'} tokens")


if __name__ == "__main__":
    main()
