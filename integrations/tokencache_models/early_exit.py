"""An early-exit small model: the first k layers of a model plus a fitted exit head.

The head replaces the final norm of `truncate_model(large, k)`: the final norm's RMSNorm (a copy
of its gain) followed by an affine map fitted by least squares so that, on text the full model
generates itself, it predicts the full model's final hidden state (the input of the shared
lm_head). With the map at identity it is plain truncation, so the fit can only improve on it
where it was fitted (LayerSkip / early-exit heads, without retraining the layers).

    python -m tokencache_models.early_exit --prompts FILE --layers 10 [--out PATH]

builds the head for the bundled SmolLM2-135M-Instruct: greedy generations of the full model
from the prompts (one a line, each wrapped in the chat template), the hidden states after layer
k captured on the way, the fit and --distill-epochs of distillation, a checkpoint (default under
the cache dir, see cache_dir()). tokencache_routing.tools.labels builds the same head on the train
prompts of its own prompt set (what the demo and the quality curve use).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .forward.forward_batch import ForwardBatch
from .layers import RMSNorm
from .loader import truncate_model
from .model import CausalLM

FORMAT = "tokencache-exit-head-v1"
CACHE_ENV = "TOKENCACHE_CACHE"


def cache_dir() -> Path:
    """$TOKENCACHE_CACHE, else ~/.cache/tokencache (built artefacts: never committed)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "tokencache"


class ExitHead(RMSNorm):
    """RMSNorm (the final norm's gain, copied) then an affine map: the small model's final norm.

    A subclass of RMSNorm so that it takes the norm's place in the model unchanged; the runner
    applies it to each request's last token, so the router reads its output as `out.hidden`.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.proj = nn.Linear(dim, dim)
        with torch.no_grad():  # identity: plain truncation until fitted
            self.proj.weight.copy_(torch.eye(dim))
            self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.proj(super().forward(x))
        return y

    @classmethod
    def from_norm(cls, norm: RMSNorm) -> ExitHead:
        head = cls(norm.weight.shape[0], norm.eps)
        with torch.no_grad():
            head.weight.copy_(norm.weight)
        return head.to(device=norm.weight.device, dtype=norm.weight.dtype)


@torch.no_grad()
def fit_exit_head(
    norm: RMSNorm, layer_hidden: torch.Tensor, target: torch.Tensor, ridge: float = 1e-3
) -> ExitHead:
    """Least squares for the map on top of `norm`: target ~ W norm(layer_hidden) + b.

    layer_hidden [N, H] is the residual stream after layer k, target [N, H] the full model's
    final-norm output at the same positions. The fit is of the residual target - norm(x), with
    a ridge penalty (relative to the features' mean square) pulling W towards the identity.
    """
    head = ExitHead.from_norm(norm)
    u = RMSNorm.forward(head, layer_hidden.to(head.weight.dtype)).double()
    y = target.double()
    n, h = u.shape
    a = torch.cat((u, torch.ones(n, 1, dtype=u.dtype)), 1)
    gram = a.T @ a
    lam = ridge * float(gram.diagonal()[:h].mean())
    gram[:h, :h] += lam * torch.eye(h, dtype=u.dtype)  # the bias is not penalised
    sol = torch.linalg.solve(gram, a.T @ (y - u))  # [H + 1, H]
    head.proj.weight.copy_((torch.eye(h, dtype=u.dtype) + sol[:h]).T)
    head.proj.bias.copy_(sol[h])
    return head


def distill_exit_head(
    head: ExitHead,
    layer_hidden: torch.Tensor,
    target: torch.Tensor,
    lm_head: torch.Tensor,
    epochs: int = 4,
    lr: float = 1e-3,
    batch_size: int = 512,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> ExitHead:
    """A short distillation of a (least-squares) head: KL(full model || small model) over the
    vocabulary, through the frozen lm_head [V, H]. The squared error weighs every hidden
    direction alike; the tokens depend on a few, which this fits (in place; returns `head`).
    progress(n) after each batch of n rows."""
    gen = torch.Generator().manual_seed(seed)
    w = lm_head.detach().float()
    params = [head.weight, head.proj.weight, head.proj.bias]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x, y = layer_hidden.float().clone(), target.float().clone()
            for _ in range(epochs):
                perm = torch.randperm(len(x), generator=gen)
                for i in range(0, len(x), batch_size):
                    idx = perm[i : i + batch_size]
                    with torch.no_grad():
                        want = torch.log_softmax(y[idx] @ w.T, -1)
                    got = torch.log_softmax(head(x[idx]) @ w.T, -1)
                    loss = nn.functional.kl_div(got, want, log_target=True, reduction="batchmean")
                    opt.zero_grad()
                    loss.backward()  # type: ignore[no-untyped-call]
                    opt.step()
                    if progress is not None:
                        progress(len(idx))
    finally:
        for p in params:
            p.requires_grad_(False)
    return head


def early_exit_model(large: CausalLM, num_layers: int, head: ExitHead) -> CausalLM:
    """The first num_layers layers of `large` (shared weights) with `head` as its final norm."""
    small = truncate_model(large, num_layers)
    small.model.norm = head.to(device=large.device, dtype=large.dtype)
    return small


def save_exit_head(
    path: str | Path, num_layers: int, head: ExitHead, meta: dict[str, Any] | None = None
) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt = {
        "format": FORMAT,
        "num_layers": num_layers,
        "hidden_size": head.weight.shape[0],
        "eps": head.eps,
        "state_dict": {k: v.detach().cpu().float() for k, v in head.state_dict().items()},
        "meta": meta or {},
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(ckpt, tmp)
    tmp.replace(path)  # never a half-written checkpoint under the final name


def load_exit_head(path: str | Path) -> tuple[int, ExitHead, dict[str, Any]]:
    """(num_layers, head, meta) of a checkpoint written by save_exit_head."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path}: not an exit-head checkpoint ({FORMAT})")
    head = ExitHead(int(ckpt["hidden_size"]), float(ckpt["eps"]))
    head.load_state_dict(ckpt["state_dict"])
    return int(ckpt["num_layers"]), head.eval(), dict(ckpt["meta"])


def load_early_exit(large: CausalLM, path: str | Path) -> CausalLM:
    """The small model of a checkpoint, over `large`'s own layers."""
    k, head, _ = load_exit_head(path)
    cfg = large.config
    if head.weight.shape[0] != cfg.hidden_size or not 0 < k < cfg.num_hidden_layers:
        raise ValueError(
            f"{path}: a head for {k} layers of hidden size {head.weight.shape[0]} does not fit "
            f"this model ({cfg.num_hidden_layers} layers, hidden size {cfg.hidden_size})"
        )
    return early_exit_model(large, k, head)


@dataclass
class GreedyTrace:
    """The full model's greedy generations with hidden states captured on the way.

    Row r is the state just before generated token r: the residual stream after each layer in
    `layer_hidden` (layer index -> [N, H]) and the final-norm output `final_hidden` [N, H] at
    the last token fed; `tokens[r]` is the token the model then wrote. Prompt j owns rows
    offsets[j]:offsets[j + 1] (its generation stops after eos or max_new tokens).
    """

    tokens: torch.Tensor  # [N] int64
    final_hidden: torch.Tensor  # [N, H]
    layer_hidden: dict[int, torch.Tensor]
    offsets: torch.Tensor  # [P + 1] int64

    def rows(self, prompts: Sequence[int]) -> torch.Tensor:
        """Row indices of the given prompts, in order."""
        o = self.offsets.tolist()
        parts = [torch.arange(o[j], o[j + 1]) for j in prompts]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def answers(self) -> list[list[int]]:
        o, t = self.offsets.tolist(), self.tokens.tolist()
        return [t[o[j] : o[j + 1]] for j in range(len(o) - 1)]


def _batches(n: int, size: int) -> Iterator[range]:
    for i in range(0, n, size):
        yield range(i, min(i + size, n))


@torch.no_grad()
def greedy_trace(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    layers: Sequence[int],
    eos_token_id: int | None = None,
    batch_size: int = 32,
    progress: Callable[[int], None] | None = None,
) -> GreedyTrace:
    """Greedy generation of `model` over the prompts in batches, through the paged runner,
    capturing the residual stream after each of `layers` (1-based counts of layers) for the
    token fed at each step. progress(n) is called after each step with the tokens of the
    max_new_tokens budgets done (an answer ended by eos counts its whole budget)."""
    if model.uses_fusions():
        raise ValueError("greedy_trace reads each layer's output: turn model.fused off")
    for k in layers:
        if not 0 < k <= model.config.num_hidden_layers:
            raise ValueError(f"layer {k} outside 1..{model.config.num_hidden_layers}")
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[k - 1].register_forward_hook(
            lambda _m, _i, out, k=k: seen.__setitem__(k, out)
        )
        for k in layers
    ]
    rows: list[list[tuple[int, torch.Tensor, dict[int, torch.Tensor]]]] = [[] for _ in prompts]
    try:
        for idx in _batches(len(prompts), batch_size):
            _trace_batch(model, prompts, idx, max_new_tokens, eos_token_id, seen, rows, progress)
    finally:
        for hk in hooks:
            hk.remove()
    flat = [r for per in rows for r in per]
    counts = torch.tensor([0, *map(len, rows)], dtype=torch.int64)
    h = model.config.hidden_size
    return GreedyTrace(
        tokens=torch.tensor([r[0] for r in flat], dtype=torch.int64),
        final_hidden=torch.stack([r[1] for r in flat]) if flat else torch.zeros(0, h),
        layer_hidden={
            k: torch.stack([r[2][k] for r in flat]) if flat else torch.zeros(0, h) for k in layers
        },
        offsets=counts.cumsum(0),
    )


def _trace_batch(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    idx: range,
    max_new: int,
    eos: int | None,
    seen: dict[int, torch.Tensor],
    rows: list[list[tuple[int, torch.Tensor, dict[int, torch.Tensor]]]],
    progress: Callable[[int], None] | None,
) -> None:
    reqs = list(idx)
    pool = model.make_kv_pool(sum(len(prompts[j]) for j in reqs) + len(reqs) * max_new + 1)
    slots = {j: pool.alloc(len(prompts[j])) for j in reqs}
    feed = {j: list(prompts[j]) for j in reqs}
    prefix: dict[int, torch.Tensor] = {j: torch.zeros(0, dtype=torch.int64) for j in reqs}
    for _ in range(max_new):
        if not reqs:
            break
        fb = ForwardBatch.from_requests(
            [feed[j] for j in reqs], [prefix[j] for j in reqs], [slots[j] for j in reqs]
        )
        out = model(fb, pool)
        last = fb.q_offsets[1:] - 1  # each request's last fed token among the batch's rows
        nxt = out.logits.argmax(-1).tolist()
        still, skipped = [], 0
        for i, j in enumerate(reqs):
            per_layer = {k: v[last[i]].clone() for k, v in seen.items()}
            rows[j].append((int(nxt[i]), out.hidden[i].clone(), per_layer))
            prefix[j] = torch.cat((prefix[j], slots[j]))
            if nxt[i] != eos and len(rows[j]) < max_new:
                still.append(j)
                feed[j] = [int(nxt[i])]
                slots[j] = pool.alloc(1)
            else:
                skipped += max_new - len(rows[j])  # an early eos: its budget counts as done
        if progress is not None:
            progress(len(reqs) + skipped)
        reqs = still


def chat_prompts(tokenizer: Any, questions: Sequence[str]) -> list[list[int]]:
    """Each question as one user turn in the tokenizer's chat template, ready to generate."""
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def default_path(num_layers: int) -> Path:
    return cache_dir() / f"smollm2-135m-exit-{num_layers}.pt"


def build_smollm2_exit_head(
    questions: Sequence[str],
    num_layers: int,
    out: str | Path,
    max_new_tokens: int = 32,
    ridge: float = 1e-3,
    batch_size: int = 32,
    distill_epochs: int = 4,
) -> Path:
    """Generations of the bundled SmolLM2-135M from `questions`, the fit (least squares, then
    distill_epochs of distill_exit_head), the checkpoint."""
    from tqdm import tqdm

    from .loader import find_smollm2_gguf, load_smollm2_gguf

    g = load_smollm2_gguf(dtype=torch.float32, attention_backend="torch")
    prompts = chat_prompts(g.tokenizer, questions)
    with tqdm(total=len(prompts) * max_new_tokens, desc="greedy generations", unit="tok") as bar:
        trace = greedy_trace(
            g.model,
            prompts,
            max_new_tokens,
            [num_layers],
            g.tokenizer.eos_token_id,
            batch_size,
            bar.update,
        )
    x, y = trace.layer_hidden[num_layers], trace.final_hidden
    head = fit_exit_head(g.model.model.norm, x, y, ridge)
    if distill_epochs:
        total = distill_epochs * len(y)
        with tqdm(total=total, desc="exit head distillation", unit="row") as bar:
            distill_exit_head(
                head, x, y, g.model.lm_head.weight, distill_epochs, progress=bar.update
            )
    base = ExitHead.from_norm(g.model.model.norm)
    with torch.no_grad():
        err = float((head(x) - y).pow(2).mean() / y.pow(2).mean())
        err0 = float((base(x) - y).pow(2).mean() / y.pow(2).mean())
    meta = {
        "base": f"smollm2:{find_smollm2_gguf()[1]}",
        "prompts": len(prompts),
        "rows": len(y),
        "max_new_tokens": max_new_tokens,
        "ridge": ridge,
        "distill_epochs": distill_epochs,
        "relative_mse": err,
        "relative_mse_truncation": err0,
    }
    save_exit_head(out, num_layers, head, meta)
    print(
        f"exit head after {num_layers} layers fitted on {len(y)} rows: relative MSE {err:.3f} "
        f"(plain truncation {err0:.3f}) -> {out}"
    )
    return Path(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", required=True, help="questions, one a line")
    ap.add_argument("--layers", type=int, default=10, help="layers kept (of 30)")
    ap.add_argument("--out", default=None, help="checkpoint (default: the cache dir)")
    ap.add_argument("--max-new", type=int, default=32, help="generated tokens per prompt")
    ap.add_argument("--ridge", type=float, default=1e-3)
    ap.add_argument("--distill-epochs", type=int, default=4, help="KL epochs after the fit")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    questions = [q for q in Path(a.prompts).read_text().splitlines() if q.strip()]
    out = a.out or default_path(a.layers)
    build_smollm2_exit_head(
        questions, a.layers, out, a.max_new, a.ridge, distill_epochs=a.distill_epochs
    )


if __name__ == "__main__":
    main()
