"""Divergence labels from real greedy generations of the bundled SmolLM2-135M.

    python -m tokencache_routing labels [--layers 10] [--prompts N] [--max-new 32]

1. The large model (all 30 layers) answers every prompt of data/prompts.txt greedily through
   the paged runner; the residual stream after layer k is captured at each step (one pass: the
   small model is the first k layers, so along the large model's answer its layer-k state is
   the large model's own).
2. The exit head is fitted on the train prompts (tokencache_models.early_exit: least squares,
   then --distill-epochs of KL distillation through the lm_head) and saved; the router's
   train rows are the same prompts' (--head-split: the head on half of them, the router's
   rows from the other half). No test prompt is seen by either.
3. At every row the small model's features follow (exit head, shared lm_head): its final
   hidden state, its greedy token's embedding, its top-k logits, entropy and top-1
   probability; label 1 where its greedy token differs from the large model's own next token.
   Train and test rows go to separate files in the train_router format.

While a routed answer still equals the large model's own, its context is the large model's
answer, so these rows are exactly what a router sees before the first difference.
Everything is written under cache_dir()/routing-quality and reused when present.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokencache_extras import require_or_exit

if TYPE_CHECKING:
    import torch

    from tokencache_models import CausalLM
    from tokencache_models.early_exit import ExitHead, GreedyTrace

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "prompts.txt"
TEST_SHARE = 0.25
TRACE_LAYERS = (8, 10, 11, 12, 14)
FEATURE_KEYS = ("hidden", "token_emb", "topk_logits", "label")


def work_dir() -> Path:
    from tokencache_models.early_exit import cache_dir

    return cache_dir() / "routing-quality"


def load_questions(n: int | None = None, path: Path = PROMPTS_FILE) -> list[str]:
    qs = [q for q in path.read_text().splitlines() if q.strip()]
    return qs[:n] if n else qs


def split_prompts(n: int, test_share: float = TEST_SHARE) -> tuple[list[int], list[int]]:
    """(train, test) prompt indices: the last test_share of the (already shuffled) file is test,
    so a prompt is never in both and a smaller --prompts keeps the same proportion."""
    n_test = max(1, round(n * test_share)) if n > 1 else 0
    return list(range(n - n_test)), list(range(n - n_test, n))


@dataclass
class SmallRows:
    """The small model's view at trace rows: train_router features plus the baselines' scores."""

    hidden: torch.Tensor  # [N, H] exit-head output
    token_emb: torch.Tensor  # [N, E] embedding of the small model's greedy token
    topk_logits: torch.Tensor  # [N, k]
    label: torch.Tensor  # [N] 1.0 where the small greedy token differs from the large one's
    entropy: torch.Tensor  # [N] nats
    top1_prob: torch.Tensor  # [N]
    small_tokens: torch.Tensor  # [N]

    def features(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in FEATURE_KEYS}


def small_rows(
    large: CausalLM,
    head: ExitHead,
    layer_hidden: torch.Tensor,
    large_tokens: torch.Tensor,
    top_k: int = 100,
    chunk: int = 512,
) -> SmallRows:
    """The small model's outputs at the given rows, from the captured layer-k states (the same
    head and lm_head the early-exit model applies to its last token)."""
    import torch

    parts: dict[str, list[torch.Tensor]] = {}
    emb = large.model.embed_tokens.weight
    with torch.no_grad():
        for i in range(0, len(layer_hidden), chunk):
            x = layer_hidden[i : i + chunk].to(large.dtype)
            hid = head(x)
            logits = large.lm_head(hid).float()
            lp = torch.log_softmax(logits, -1)
            tok = logits.argmax(-1)
            got = {
                "hidden": hid.float(),
                "token_emb": emb[tok].float(),
                "topk_logits": logits.topk(min(top_k, logits.shape[-1]), -1).values,
                "entropy": -(lp.exp() * lp).sum(-1),
                "top1_prob": lp.max(-1).values.exp(),
                "small_tokens": tok,
            }
            for k, v in got.items():
                parts.setdefault(k, []).append(v)
    out = {k: torch.cat(v) for k, v in parts.items()}
    label = (out["small_tokens"] != large_tokens).float()
    return SmallRows(label=label, **out)


def trace_path(n_prompts: int, max_new: int) -> Path:
    return work_dir() / f"trace-p{n_prompts}-m{max_new}.pt"


def save_trace(trace: GreedyTrace, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "tokens": trace.tokens,
            "final_hidden": trace.final_hidden,
            "layer_hidden": trace.layer_hidden,
            "offsets": trace.offsets,
        },
        tmp,
    )
    tmp.replace(path)


def load_trace(path: Path) -> GreedyTrace:
    import torch

    from tokencache_models.early_exit import GreedyTrace

    d = torch.load(path, map_location="cpu", weights_only=True)
    return GreedyTrace(d["tokens"], d["final_hidden"], dict(d["layer_hidden"]), d["offsets"])


def build_trace(
    large: CausalLM, tokenizer: Any, questions: Sequence[str], max_new: int, path: Path
) -> GreedyTrace:
    """The large model's greedy answers with layer states (cached at `path`)."""
    from tqdm import tqdm

    from tokencache_models.early_exit import chat_prompts, greedy_trace

    if path.exists():
        return load_trace(path)
    prompts = chat_prompts(tokenizer, questions)
    with tqdm(total=len(prompts) * max_new, desc="large model answers", unit="tok") as bar:
        trace = greedy_trace(
            large, prompts, max_new, TRACE_LAYERS, tokenizer.eos_token_id, 32, bar.update
        )
    save_trace(trace, path)
    return trace


@dataclass
class Labelled:
    """Everything the curve and the router need, for one k."""

    num_layers: int
    head_path: Path
    train: SmallRows
    test: SmallRows
    train_prompts: list[int]  # the prompts of `train` (the router's)
    test_prompts: list[int]
    trace: GreedyTrace
    head_prompts: list[int]  # the exit head's, apart from both


def label(
    large: CausalLM,
    tokenizer: Any,
    num_layers: int = 10,
    n_prompts: int | None = None,
    max_new: int = 32,
    ridge: float = 1e-3,
    distill_epochs: int = 4,
    out_dir: Path | None = None,
    head_split: bool = False,
) -> Labelled:
    import torch
    from tqdm import tqdm

    from tokencache_models.early_exit import (
        distill_exit_head,
        fit_exit_head,
        load_exit_head,
        save_exit_head,
    )

    if num_layers not in TRACE_LAYERS:
        raise ValueError(f"--layers must be one of the traced layers {TRACE_LAYERS}")
    questions = load_questions(n_prompts)
    out_dir = out_dir or work_dir()
    trace = build_trace(
        large, tokenizer, questions, max_new, out_dir / trace_path(len(questions), max_new).name
    )
    train_p, test_p = split_prompts(len(questions))
    te = trace.rows(test_p)
    x = trace.layer_hidden[num_layers]
    stem = f"k{num_layers}-p{len(questions)}-m{max_new}-d{distill_epochs}"

    def fitted(path: Path, rows: torch.Tensor, what: str) -> ExitHead:
        """The head fitted on `rows` (least squares, then the distillation), cached at path."""
        if path.exists():
            return load_exit_head(path)[1].to(dtype=large.dtype)
        y = trace.final_hidden[rows]
        head = fit_exit_head(large.model.norm, x[rows], y, ridge)
        if distill_epochs:
            total = distill_epochs * len(rows)
            with tqdm(total=total, desc=f"exit head distillation ({what})", unit="row") as bar:
                distill_exit_head(
                    head, x[rows], y, large.lm_head.weight, distill_epochs, progress=bar.update
                )
        with torch.no_grad():
            y_te = trace.final_hidden[te]
            err = float((head(x[te]) - y_te).pow(2).mean() / y_te.pow(2).mean())
        meta = {"rows": len(rows), "ridge": ridge, "distill_epochs": distill_epochs}
        save_exit_head(path, num_layers, head, {**meta, "test_rel_mse": err})
        return head.to(dtype=large.dtype)

    if head_split:
        # Head and router from different prompts (even and odd train prompts): a head scores
        # the rows it was fitted on better than new text (at 10 layers 50% of those tokens
        # differ, 65% of new ones), so the router then learns on text like what it will meet.
        head_p, router_p = train_p[0::2], train_p[1::2]
        head_path = out_dir / f"exit-head-{stem}-half.pt"
    else:
        # Both from every train prompt: more text for each (on the held-out prompts this did
        # better, BENCHMARKS.md "Routing quality").
        head_p, router_p = train_p, train_p
        head_path = out_dir / f"exit-head-{stem}.pt"
    # One head everywhere: the router reads the head's output.
    head = fitted(head_path, trace.rows(head_p), "head prompts")
    own = trace.rows(router_p)
    train = small_rows(large, head, x[own], trace.tokens[own])
    test = small_rows(large, head, x[te], trace.tokens[te])
    tag = head_path.stem.removeprefix("exit-head-")
    for name, rows in (("train", train), ("test", test)):
        path = out_dir / f"features-{name}-{tag}.pt"
        if not path.exists():  # for train_router's command line; the same rows every time
            torch.save(rows.features(), path)
    return Labelled(num_layers, head_path, train, test, router_p, test_p, trace, head_p)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=10, help=f"small model's layers {TRACE_LAYERS}")
    ap.add_argument("--prompts", type=int, default=None, help="first N prompts (default all)")
    ap.add_argument("--max-new", type=int, default=32, help="tokens per large answer")
    ap.add_argument("--distill-epochs", type=int, default=4, help="exit head KL epochs")
    ap.add_argument("--head-split", action="store_true", help="head and router on apart prompts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    a = ap.parse_args(argv)
    require_or_exit("torch", "transformers", "gguf", "tqdm", extra="routing", prog="labels")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from tokencache_models import load_smollm2_gguf

    torch.set_num_threads(a.threads)
    g = load_smollm2_gguf(dtype=torch.float32, attention_backend="torch")
    lab = label(
        g.model,
        g.tokenizer,
        a.layers,
        a.prompts,
        a.max_new,
        distill_epochs=a.distill_epochs,
        head_split=a.head_split,
    )
    for name, rows in (("train", lab.train), ("test", lab.test)):
        print(
            f"{name}: {len(rows.label)} rows, {float(rows.label.mean()):.1%} where the small "
            f"model's token differs -> {work_dir()}"
        )
