"""Routing quality: escalated share against agreement with the large model alone.

    python -m tokencache_routing quality [--layers 10] [--prompts N] [--out bench-out/quality]

Builds (or reuses, from the cache dir) the divergence labels of tools/labels.py, trains
the NeuralRouter on the train prompts' rows, and sweeps the threshold of the entropy, top-1
probability and neural routers over the held-out prompts. For each threshold:

- escalated share: the share of the large model's answer tokens at which the router escalates;
- token agreement: the share of the large model's answer tokens that the routed answer
  reproduces before its first difference (a kept small-model token that differs from the
  large model's is that first difference);
- exact match: the share of answers identical to the large model's own;
- token match: the share of tokens equal to the large model's at the large model's context
  (escalated, or the small model agreed), per token, wherever the first difference falls.

Before the first difference the routed context is the large model's own answer, so agreement
and exact match are what the engine produces (greedy, deterministic router); the share is
scored along the large model's answer (after a difference the engine's context, hence its
escalations, differ). --engine-check runs the real RoutedEngine at the 15% points and prints
both. Writes quality.md (table), quality.json and quality.png to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokencache_extras import require_or_exit

if TYPE_CHECKING:
    import torch

    from tokencache_models import CausalLM

    from ..core.routers import NeuralRouter
    from .labels import Labelled, SmallRows

SHARES = (0.0, 0.025, 0.05, 0.075, 0.10, 0.125, 0.15, 0.20, 0.25, 0.30, 0.40, 0.50, 0.75, 1.0)
# The plot's grid: the table's and every 5% between.
CURVE_SHARES = tuple(sorted({*SHARES, *(i / 20 for i in range(21))}))
OPERATING_SHARE = 0.15
ROUTERS = ("entropy", "top1-prob", "neural")


@dataclass
class Point:
    router: str
    threshold: float  # on the router's own scale (nats, probability, sigmoid score)
    share: float  # escalated share along the large model's answers
    token_agreement: float
    exact_match: float
    # Share of rows where the routed token is the large model's at the large model's context
    # (escalated, or the small model agreed): per-token quality, blind to where the first
    # difference falls.
    token_match: float = 0.0


def agreement(
    escalate: np.ndarray, differs: np.ndarray, offsets: Sequence[int]
) -> tuple[float, float, float]:
    """(escalated share, token agreement before the first difference, exact-match share).

    escalate[r], differs[r] per row of the large model's answers; answer j owns rows
    offsets[j]:offsets[j + 1]. A row that differs and is not escalated is a difference.
    """
    escalate, differs = np.asarray(escalate, bool), np.asarray(differs, bool)
    bad = differs & ~escalate
    agreed = exact = 0
    for a, b in itertools.pairwise(offsets):
        hits = np.flatnonzero(bad[a:b])
        first = int(hits[0]) if len(hits) else b - a
        agreed += first
        exact += first == b - a
    n, m = len(escalate), len(offsets) - 1
    return float(escalate.mean()) if n else 0.0, agreed / max(n, 1), exact / max(m, 1)


def sweep(
    name: str,
    scores: np.ndarray,
    differs: np.ndarray,
    offsets: Sequence[int],
    shares: Sequence[float] = SHARES,
    scale: Any = None,
) -> list[Point]:
    """Points at thresholds that escalate the given shares of rows (score >= threshold
    escalates; scale maps a score threshold back to the router's own units)."""
    scores = np.asarray(scores, np.float64)
    out = []
    for s in shares:
        if s <= 0:
            thr = np.inf
        elif s >= 1:
            thr = -np.inf
        else:
            thr = float(np.quantile(scores, 1.0 - s, method="higher"))
        esc = scores >= thr
        share, tok, exact = agreement(esc, differs, offsets)
        own = float(scale(thr)) if scale is not None and np.isfinite(thr) else float(thr)
        match = 1.0 - float((np.asarray(differs, bool) & ~esc).mean())
        out.append(Point(name, own, share, tok, exact, match))
    return out


def at_share(points: Sequence[Point], share: float) -> float:
    """Token agreement linearly interpolated at `share` (points of one router)."""
    xs = np.array([p.share for p in points])
    ys = np.array([p.token_agreement for p in points])
    order = np.argsort(xs, kind="stable")
    return float(np.interp(share, xs[order], ys[order]))


def neural_scores(router: NeuralRouter, rows: SmallRows) -> np.ndarray:
    import torch

    with torch.no_grad():
        s = torch.sigmoid(router(rows.hidden, rows.token_emb, rows.topk_logits))
    out: np.ndarray = s.double().numpy()
    return out


def router_scores(rows: SmallRows, neural: NeuralRouter | None) -> dict[str, tuple[Any, Any]]:
    """name -> (scores where higher escalates, map from score threshold to the router's own)."""
    out: dict[str, tuple[Any, Any]] = {
        "entropy": (rows.entropy.double().numpy(), None),
        "top1-prob": (-rows.top1_prob.double().numpy(), lambda t: -t),
    }
    if neural is not None:
        out["neural"] = (neural_scores(neural, rows), None)
    return out


def random_curve(
    differs: np.ndarray, offsets: Sequence[int], shares: Sequence[float], seed: int = 0
) -> list[Point]:
    """A router that escalates each token with probability p (mean of 20 draws)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in shares:
        draws = [rng.random(len(differs)) < s for _ in range(20)]
        runs = [(*agreement(e, differs, offsets), 1 - float((differs & ~e).mean())) for e in draws]
        sh, tok, ex, match = (float(np.mean(v)) for v in zip(*runs, strict=True))
        out.append(Point("random", s, sh, tok, ex, match))
    return out


def point_at(
    name: str,
    train_scores: np.ndarray,
    test_scores: np.ndarray,
    differs: np.ndarray,
    offsets: Sequence[int],
    share: float,
    scale: Any = None,
) -> Point:
    """The held-out point of a threshold chosen on the train rows to escalate `share` of them
    (an operating point set without looking at the test prompts)."""
    thr = float(np.quantile(np.asarray(train_scores, np.float64), 1.0 - share))
    esc = np.asarray(test_scores, np.float64) >= thr
    sh, tok, exact = agreement(esc, differs, offsets)
    match = 1.0 - float((np.asarray(differs, bool) & ~esc).mean())
    own = float(scale(thr)) if scale is not None else thr
    return Point(name, own, sh, tok, exact, match)


def load_or_train_router(
    lab: Labelled,
    embedding: torch.Tensor,
    retrain: bool = False,
    epochs: int = 20,
    seed: int = 0,
) -> tuple[NeuralRouter, Path]:
    """The neural router of these labels, from the cache dir or trained on the train rows."""
    from ..core.routers import NeuralRouter

    tag = f"-s{seed}" if seed else ""
    path = lab.head_path.with_name(
        "router-" + lab.head_path.name.removeprefix("exit-head-").replace(".pt", f"{tag}.pt")
    )
    if path.exists() and not retrain:
        return NeuralRouter.load(path, embedding=embedding), path
    print(f"training the neural router on {len(lab.train.label)} rows")
    router = train_neural(lab, path, epochs, seed)
    router.embedding = embedding.detach().clone()
    return router, path


def test_offsets(lab: Labelled) -> list[int]:
    """Row offsets of the test answers within lab.test."""
    o = lab.trace.offsets.tolist()
    out = [0]
    for j in lab.test_prompts:
        out.append(out[-1] + o[j + 1] - o[j])
    return out


def train_neural(lab: Labelled, out: Path, epochs: int = 20, seed: int = 0) -> NeuralRouter:
    """The NeuralRouter on the train rows, its threshold set for OPERATING_SHARE of them."""
    from tqdm import tqdm

    from .train_router import train

    feats = lab.train.features()
    with tqdm(total=epochs * len(lab.train.label), desc="router training", unit="row") as bar:
        router = train(feats, epochs=epochs, seed=seed, progress=bar.update)
    train_scores = neural_scores(router, lab.train)
    # The operating point is chosen on train rows; the test rows only measure it.
    router.threshold = float(np.quantile(train_scores, 1.0 - OPERATING_SHARE))
    out.parent.mkdir(parents=True, exist_ok=True)
    router.save(out)
    return router


def cost_per_token(
    small: CausalLM, large: CausalLM, batch: int, context: int = 64, steps: int = 12
) -> tuple[float, float]:
    """Median seconds per decode step of each model (interleaved, so that a busy spell of a
    shared machine hits both) at `batch` requests of `context` tokens."""
    import torch

    from tokencache_models import ForwardBatch

    def setup(m: CausalLM) -> tuple[Any, list[torch.Tensor]]:
        pool = m.make_kv_pool(batch * (context + steps + 1))
        slots = [pool.alloc(context) for _ in range(batch)]
        m(ForwardBatch.from_requests([[1] * context] * batch, [[]] * batch, slots), pool)
        return pool, slots

    state = {id(m): setup(m) for m in (small, large)}
    times: dict[int, list[float]] = {id(small): [], id(large): []}
    for _ in range(steps):
        for m in (small, large):
            pool, slots = state[id(m)]
            new = [pool.alloc(1) for _ in range(batch)]
            fb = ForwardBatch.from_requests([[5]] * batch, slots, new)
            t0 = time.perf_counter()
            m(fb, pool)
            times[id(m)].append(time.perf_counter() - t0)
            state[id(m)] = (pool, [torch.cat((a, b)) for a, b in zip(slots, new, strict=True)])
    return float(np.median(times[id(small)])), float(np.median(times[id(large)]))


def plot(points: Sequence[Point], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(dict.fromkeys(p.router for p in points))
    for ax, key, label in (
        (axes[0], "token_agreement", "token agreement before the first difference"),
        (axes[1], "exact_match", "answers identical to the large model's"),
        (axes[2], "token_match", "tokens equal to the large model's at its context"),
    ):
        for name in names:
            pts = sorted((p for p in points if p.router == name), key=lambda p: p.share)
            style = ":" if name == "random" else "-"
            ax.plot(
                [100 * p.share for p in pts],
                [100 * getattr(p, key) for p in pts],
                style,
                marker="o" if name != "random" else None,
                ms=3,
                label=name,
            )
        ax.axvline(100 * OPERATING_SHARE, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("tokens escalated to the large model (%)")
        ax.set_ylabel(f"{label} (%)")
        ax.set_xlim(0, 100)
        ax.set_ylim(0, 101)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def table(points: Sequence[Point], shares: Sequence[float]) -> str:
    names = [n for n in (*ROUTERS, "random") if any(p.router == n for p in points)]
    head = "| escalated | " + " | ".join(names) + " |"
    rows = [head, "|---:|" + "---:|" * len(names)]
    for s in shares:
        cells = []
        for n in names:
            p = min((p for p in points if p.router == n), key=lambda p: abs(p.share - s))
            cells.append(
                f"{100 * p.token_agreement:.1f} / {100 * p.exact_match:.0f} / "
                f"{100 * p.token_match:.0f}"
            )
        rows.append(f"| {100 * s:.1f}% | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def engine_check(
    small: CausalLM,
    large: CausalLM,
    lab: Labelled,
    routers: dict[str, Any],
    eos: int | None,
    max_new: int,
    prompts: Sequence[Sequence[int]],
) -> list[dict[str, float | str]]:
    """The real RoutedEngine on the test prompts with each router: share of tokens the large
    model wrote, token agreement and exact match against the large model's own answers."""
    from .. import EngineConfig, RoutedEngine, SchedulerConfig

    answers = lab.trace.answers()
    out: list[dict[str, float | str]] = []
    test = [list(prompts[j]) for j in lab.test_prompts]
    refs = [answers[j] for j in lab.test_prompts]
    for name, router in routers.items():
        eng = RoutedEngine(
            small,
            large,
            router,
            config=EngineConfig(
                num_slots=sum(map(len, test)) + len(test) * (max_new + 2),
                scheduler=SchedulerConfig(max_running=32),
                eos_token_id=eos,
            ),
        )
        res = eng.generate(test, max_new)
        n = sum(map(len, res.tokens))
        esc = sum(map(sum, res.models))
        agreed = exact = 0
        for toks, ref in zip(res.tokens, refs, strict=True):
            k = 0
            while k < min(len(toks), len(ref)) and toks[k] == ref[k]:
                k += 1
            agreed += k
            exact += toks == ref
        out.append(
            {
                "router": name,
                "share": esc / max(n, 1),
                "token_agreement": agreed / max(sum(map(len, refs)), 1),
                "exact_match": exact / len(test),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=10, help="small model's layers (of 30)")
    ap.add_argument("--prompts", type=int, default=None, help="first N prompts (default all)")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=20, help="router training epochs")
    ap.add_argument("--distill-epochs", type=int, default=4, help="exit head KL epochs")
    ap.add_argument("--retrain", action="store_true", help="train the router even if cached")
    ap.add_argument("--engine-check", action="store_true", help="real engine at the 15%% points")
    ap.add_argument(
        "--head-split", action="store_true", help="exit head and router on apart train prompts"
    )
    ap.add_argument("--seed", type=int, default=0, help="router training seed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default="bench-out/quality")
    a = ap.parse_args(argv)
    require_or_exit("torch", "transformers", "gguf", "tqdm", extra="routing", prog="quality")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from tokencache_models import load_smollm2_gguf
    from tokencache_models.early_exit import chat_prompts, load_early_exit

    from ..core.routers import EntropyRouter, NeuralRouter, Top1ProbRouter
    from .labels import label, load_questions

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    g = load_smollm2_gguf(dtype=torch.float32, attention_backend="torch")
    large, tok = g.model, g.tokenizer
    lab = label(
        large,
        tok,
        a.layers,
        a.prompts,
        a.max_new,
        distill_epochs=a.distill_epochs,
        head_split=a.head_split,
    )
    n_q = len(lab.trace.offsets) - 1
    emb = large.model.embed_tokens.weight
    neural, router_path = load_or_train_router(lab, emb, a.retrain, a.epochs, a.seed)
    offsets = test_offsets(lab)
    differs = lab.test.label.numpy() > 0.5
    points: list[Point] = []
    for name, (scores, scale) in router_scores(lab.test, neural).items():
        points += sweep(name, scores, differs, offsets, CURVE_SHARES, scale)
    points += random_curve(differs, offsets, CURVE_SHARES)
    at = {n: at_share([p for p in points if p.router == n], OPERATING_SHARE) for n in ROUTERS}
    train_scores = router_scores(lab.train, neural)
    operating = [
        point_at(n, train_scores[n][0], sc, differs, offsets, OPERATING_SHARE, scale)
        for n, (sc, scale) in router_scores(lab.test, neural).items()
    ]
    small = load_early_exit(large, lab.head_path)
    s1, l1 = cost_per_token(small, large, 1)
    s8, l8 = cost_per_token(small, large, 8)
    title = (
        f"SmolLM2-135M (30 layers) vs its first {a.layers} + exit head; "
        f"{len(lab.test_prompts)} held-out prompts, {len(differs)} tokens, "
        f"{differs.mean():.0%} differ"
    )
    report: dict[str, Any] = {
        "layers": a.layers,
        "head_prompts": len(lab.head_prompts),
        "router_prompts": len(lab.train_prompts),
        "test_prompts": len(lab.test_prompts),
        "train_rows": len(lab.train.label),
        "test_rows": len(differs),
        "test_differs": float(differs.mean()),
        "train_differs": float(lab.train.label.mean()),
        "agreement_at_15": at,
        "cost_s": {"small_b1": s1, "large_b1": l1, "small_b8": s8, "large_b8": l8},
        "points": [asdict(p) for p in points],
        "neural_threshold": neural.threshold,
        "operating": [asdict(p) for p in operating],
    }
    if a.engine_check:
        ops = {p.router: p for p in points if p.share > 0 and abs(p.share - OPERATING_SHARE) < 1e-9}
        routers: dict[str, Any] = {}
        for name in ROUTERS:
            pts = [p for p in points if p.router == name]
            p = ops.get(name) or min(pts, key=lambda q: abs(q.share - OPERATING_SHARE))
            if name == "entropy":
                routers[name] = EntropyRouter(p.threshold)
            elif name == "top1-prob":
                # Top1ProbRouter escalates below its threshold; the sweep escalated at or below.
                routers[name] = Top1ProbRouter(float(np.nextafter(p.threshold, 1.0)))
            else:
                routers[name] = NeuralRouter.load(router_path, embedding=emb, threshold=p.threshold)
        prompts = chat_prompts(tok, load_questions(n_q))
        report["engine"] = engine_check(
            small, large, lab, routers, tok.eos_token_id, a.max_new, prompts
        )
    md = table(points, SHARES)
    (out / "quality.md").write_text(md + "\n")
    (out / "quality.json").write_text(json.dumps(report, indent=1) + "\n")
    plotted = plot(points, out / "quality.png", title)
    print(title)
    print(
        "token agreement before the first difference (%) / answers identical (%) / "
        "tokens equal at the large model's context (%):"
    )
    print(md)
    print(
        "at 15% escalated, token agreement: "
        + ", ".join(f"{n} {100 * v:.1f}%" for n, v in at.items())
    )
    print(
        f"cost per decode step, small / large: batch 1 {1e3 * s1:.1f} / {1e3 * l1:.1f} ms "
        f"({s1 / l1:.2f}), batch 8 {1e3 * s8:.1f} / {1e3 * l8:.1f} ms ({s8 / l8:.2f})"
    )
    for p in operating:
        print(
            f"{p.router} at its threshold for 15% of the train rows ({p.threshold:.4g}): "
            f"{100 * p.share:.1f}% escalated on the test rows, token agreement "
            f"{100 * p.token_agreement:.1f}%, exact {100 * p.exact_match:.0f}%, "
            f"token match {100 * p.token_match:.1f}%"
        )
    for e in report.get("engine", []):
        print(
            f"engine, {e['router']}: {100 * float(e['share']):.1f}% escalated, token agreement "
            f"{100 * float(e['token_agreement']):.1f}%, exact {100 * float(e['exact_match']):.0f}%"
        )
    print(f"-> {out}/quality.md, quality.json" + (", quality.png" if plotted else ""))
