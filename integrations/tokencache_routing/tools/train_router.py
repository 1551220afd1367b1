"""Train the R2R-style neural router from (features, label) files.

    python -m tokencache_routing train-router --features F [F ...] --out W [--recall 0.95]

A features file (.pt dict or .npz) holds, for N small-model steps: hidden [N, H], token_emb [N, E]
(the sampled token's embedding), topk_logits [N, k] and label [N] (1 = the large model is needed).
The threshold is set so that at least --recall of the positive training tokens escalate.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokencache_extras import require_or_exit

if TYPE_CHECKING:  # torch is imported on use, so that --help works without it
    import torch

    from ..core.routers import NeuralRouter

KEYS = ("hidden", "token_emb", "topk_logits", "label")


def load_features(paths: Sequence[str | Path]) -> dict[str, torch.Tensor]:
    import numpy as np
    import torch

    parts: dict[str, list[torch.Tensor]] = {k: [] for k in KEYS}
    for path in paths:
        if str(path).endswith(".npz"):
            with np.load(path) as z:
                d = {k: torch.from_numpy(z[k]) for k in KEYS}
        else:
            d = torch.load(path, map_location="cpu", weights_only=True)
        for k in KEYS:
            parts[k].append(torch.as_tensor(d[k]))
    out = {k: torch.cat(v).float() for k, v in parts.items()}
    if len({v.shape[0] for v in out.values()}) != 1:
        raise ValueError("features disagree on the number of rows")
    return out


def train(
    feats: dict[str, torch.Tensor],
    top_k: int = 100,
    width: int = 256,
    num_blocks: int = 2,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 256,
    recall: float = 0.95,
    seed: int = 0,
    weight_decay: float = 0.01,
    progress: Callable[[int], None] | None = None,
) -> NeuralRouter:
    """progress(n) is called after each batch of n rows (epochs x rows in all)."""
    import torch

    from ..core.routers import NeuralRouter

    torch.manual_seed(seed)
    h, e, t, y = (feats[k] for k in KEYS)
    router = NeuralRouter(h.shape[1], e.shape[1], top_k, width, num_blocks)
    opt = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=weight_decay)
    pos = float(y.sum())
    # Divergent tokens are rare (~5%): weight them up so the router does not learn "never".
    pos_weight = torch.tensor((len(y) - pos) / max(pos, 1.0))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    router.train()
    for _ in range(epochs):
        perm = torch.randperm(len(y))
        for i in range(0, len(y), batch_size):
            idx = perm[i : i + batch_size]
            loss = loss_fn(router(h[idx], e[idx], t[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if progress is not None:
                progress(len(idx))
    router.eval()
    with torch.no_grad():
        scores = torch.sigmoid(router(h, e, t))
    positives = scores[y > 0.5]
    if len(positives):
        # Highest threshold that still escalates >= recall of the positives.
        router.threshold = float(torch.quantile(positives, 1.0 - recall))
    return router


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--features", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--recall", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    require_or_exit("torch", "tqdm", extra="routing", prog="tokencache_routing train-router")
    import torch
    from tqdm import tqdm

    feats = load_features(a.features)
    with tqdm(total=a.epochs * len(feats["label"]), desc="training", unit="row") as bar:
        router = train(
            feats,
            a.top_k,
            a.width,
            a.blocks,
            a.epochs,
            a.lr,
            recall=a.recall,
            seed=a.seed,
            progress=bar.update,
        )
    router.save(a.out)
    with torch.no_grad():
        pred = torch.sigmoid(router(feats["hidden"], feats["token_emb"], feats["topk_logits"]))
    esc = pred >= router.threshold
    y = feats["label"] > 0.5
    rec = float((esc & y).sum() / max(int(y.sum()), 1))
    print(
        f"trained on {len(y)} rows ({int(y.sum())} positive): threshold {router.threshold:.4f}, "
        f"train recall {rec:.3f}, escalation rate {float(esc.float().mean()):.3f} -> {a.out}"
    )
