"""Per-row token choice of a decode step: sampling, and the router's escalation answers.

Greedy rows are one argmax over the batch. Sampled rows are one batched computation too:
softmax((logits - max) / T) per row, the top_p nucleus, and an inverse-CDF draw with one
uniform per row from the request's own seeded generator (the only per-row Python: the
generator is the request's state). A row's token depends on its logits, its parameters and
its generator only, never on its batch-mates. A row that cannot be sampled (its generator
fails, its logits are not finite) is reported in `failed`, never raised for the batch: that
request ends with its error and its batch-mates go on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokencache_models import ForwardOutput

from .routers import Router, RouterFeatures
from .state import Request

# What sample() could not draw: row index -> the error that request ends with.
Failed = dict[int, Exception]


def _uniform(r: Request) -> float:
    """The request's next uniform in [0, 1), from its generator (made on first use)."""
    if r.generator is None:
        sp = r.sampling
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)))
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        r.generator = g
    return float(torch.rand((), generator=r.generator, dtype=torch.float64))


def _draw(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits -> (token per row, row is finite). Rows are independent. top_p None:
    no nucleus (no sort); else the tokens sorted by probability, kept while the mass before
    each is below top_p (the most likely token always stays)."""
    x = logits.float()
    mx = x.max(dim=-1, keepdim=True).values
    ok = torch.isfinite(mx).squeeze(-1)  # NaN, +inf or no finite logit: not a distribution
    # (l - max) <= 0, so exp never overflows; T >= MIN_TEMPERATURE keeps the division finite.
    probs = torch.softmax((x - torch.where(ok[:, None], mx, 0.0)) / temperature[:, None], dim=-1)
    if top_p is None:
        order = None
        p = probs
    else:
        p, order = probs.sort(dim=-1, descending=True, stable=True)
        p = torch.where(p.cumsum(-1) - p < top_p[:, None], p, 0.0)
    cdf = p.double().cumsum(-1)
    target = u.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    j = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    tok = j if order is None else order.gather(-1, j)
    return tok.squeeze(-1), ok


def sample(logits: torch.Tensor, batch: Sequence[Request]) -> tuple[torch.Tensor, Failed]:
    """Next token per row: argmax for greedy requests, else a draw from softmax((l - max) / T)
    in the top_p nucleus with the request's seeded generator. Returns the tokens and the rows
    that could not be sampled (their token is a placeholder; the caller ends those requests
    with their error)."""
    tok = logits.argmax(-1)
    failed: Failed = {}
    rows = [i for i, r in enumerate(batch) if not r.sampling.greedy]
    if not rows:
        return tok, failed
    # Per row: the uniform (the generator is the request's own state); a failure stays there.
    us: dict[int, float] = {}
    for i in rows:
        try:
            us[i] = _uniform(batch[i])
        except Exception as e:
            failed[i] = e
    # Rows without a nucleus are drawn in vocabulary order, the others in probability order:
    # two groups, so a row's draw never depends on which batch-mates it has.
    groups = (
        [i for i in us if batch[i].sampling.top_p >= 1],
        [i for i in us if batch[i].sampling.top_p < 1],
    )
    for nucleus, idx in enumerate(groups):
        if not idx:
            continue
        sel = torch.tensor(idx, dtype=torch.int64, device=logits.device)
        temp = torch.tensor([batch[i].sampling.temperature for i in idx], device=logits.device)
        top_p = (
            torch.tensor([batch[i].sampling.top_p for i in idx], device=logits.device)
            if nucleus
            else None
        )
        drawn, ok = _draw(logits[sel], temp, top_p, torch.tensor([us[i] for i in idx]))
        tok[sel] = drawn.to(tok.dtype)
        if not bool(ok.all()):
            for k in torch.nonzero(~ok).flatten().tolist():
                r = batch[idx[k]]
                failed[idx[k]] = FloatingPointError(
                    f"request {r.rid}: its logits are not finite (NaN or inf), cannot sample"
                )
    return tok, failed


def route_step(
    router: Router, out: ForwardOutput, batch: Sequence[Request]
) -> tuple[torch.Tensor, list[bool], Failed]:
    """One small-model step's tokens, the router's escalate answers and the rows sample()
    could not draw. A router may answer with a bool tensor, a numpy array or a list, one
    entry per request."""
    tok, failed = sample(out.logits, batch)
    feats = RouterFeatures(
        logits=out.logits,
        hidden=out.hidden,
        tokens=tok,
        positions=torch.tensor([r.num_generated for r in batch], dtype=torch.int64),
        rids=torch.tensor([r.route_key for r in batch], dtype=torch.int64),
    )
    answer = router.route(feats)
    if isinstance(answer, torch.Tensor):
        answer = answer.detach().cpu()
    arr = np.asarray(answer)
    if arr.dtype.kind not in "biu":
        raise TypeError(f"router answered {type(answer).__name__} of {arr.dtype}, not booleans")
    decisions = torch.from_numpy(arr.astype(bool)).reshape(-1)
    if decisions.numel() != len(batch):
        raise ValueError(f"router answered {decisions.numel()} decisions for {len(batch)} requests")
    return tok, decisions.tolist(), failed
