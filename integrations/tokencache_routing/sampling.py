"""Per-row token choice of a decode step: sampling, and the router's escalation answers.

Greedy rows are one argmax over the batch. Sampled rows are one batched computation too:
softmax((logits - max) / T) per row, the top_p nucleus, and an inverse-CDF draw with one
uniform per row, uniform(seed, index) where index is the token's place in the request's
sequence (rng.py): counter-based, so a row's token depends on its logits, its parameters and
its place only, never on its batch-mates, on earlier draws, or on a step an overlapped
schedule computed and dropped. Drawing is device work (draw): nothing is read back until the
step is resolved (Draw.resolve), so the host can prepare the next step meanwhile. A row that
cannot be sampled (its seed does not fit 64 bits, its logits are not finite) is reported in
`failed`, never raised for the batch: that request ends with its error and its batch-mates go
on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokencache_models import ForwardOutput

from .rng import uniforms
from .routers import Router, RouterFeatures
from .state import Request

# What sample() could not draw: row index -> the error that request ends with.
Failed = dict[int, Exception]


def _seeds(batch: Sequence[Request], rows: list[int]) -> tuple[np.ndarray, list[int], Failed]:
    """The rows' seeds as uint64, the rows that have one, and those whose seed does not fit
    (a value past SamplingParams' validation): those fail alone."""
    seeds = [batch[i].seed for i in rows]
    try:
        return np.array(seeds, dtype=np.uint64), rows, {}
    except OverflowError:
        pass
    failed: Failed = {}
    ok = []
    for i, s in zip(rows, seeds, strict=True):
        if 0 <= s < 2**64:
            ok.append(i)
        else:
            failed[i] = OverflowError(f"Overflow: request {batch[i].rid}'s seed {s} is not 64-bit")
    return np.array([batch[i].seed for i in ok], dtype=np.uint64), ok, failed


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


@dataclass
class Draw:
    """A batch's tokens drawn on the logits' device and not yet read by the host."""

    tokens: torch.Tensor  # [B] int64, on the device
    # Per sampled group: its rows and whether each row's logits were finite (on the device).
    checks: list[tuple[list[int], torch.Tensor]]
    failed: Failed  # rows that failed on the host (their seed)

    def resolve(self, batch: Sequence[Request]) -> tuple[list[int], Failed]:
        """The tokens on the host and every row that could not be sampled (a sync point)."""
        failed = dict(self.failed)
        for idx, ok in self.checks:
            if bool(ok.all()):
                continue
            for k in torch.nonzero(~ok).flatten().tolist():
                r = batch[idx[k]]
                failed[idx[k]] = FloatingPointError(
                    f"request {r.rid}: its logits are not finite (NaN or inf), cannot sample"
                )
        return self.tokens.tolist(), failed


def draw(logits: torch.Tensor, batch: Sequence[Request], index: np.ndarray) -> Draw:
    """Next token per row, as device work: argmax for greedy requests, else a draw from
    softmax((l - max) / T) in the top_p nucleus with uniform(seed, index[i]), index[i] being
    the place of row i's token in its request's sequence."""
    tok = logits.argmax(-1)
    rows = [i for i, r in enumerate(batch) if not r.sampling.greedy]
    if not rows:
        return Draw(tok, [], {})
    seeds, rows, failed = _seeds(batch, rows)
    u = uniforms(seeds, index[rows]) if rows else np.zeros(0)
    us = dict(zip(rows, u.tolist(), strict=True))
    # Rows without a nucleus are drawn in vocabulary order, the others in probability order:
    # two groups, so a row's draw never depends on which batch-mates it has.
    groups = (
        [i for i in rows if batch[i].sampling.top_p >= 1],
        [i for i in rows if batch[i].sampling.top_p < 1],
    )
    checks: list[tuple[list[int], torch.Tensor]] = []
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
        checks.append((idx, ok))
    return Draw(tok, checks, failed)


def sample(
    logits: torch.Tensor, batch: Sequence[Request], index: np.ndarray | None = None
) -> tuple[torch.Tensor, Failed]:
    """draw() resolved at once: the tokens (a tensor) and the rows that could not be sampled
    (their token is a placeholder; the caller ends those requests with their error). index
    defaults to each request's next place, r.n."""
    if index is None:
        index = np.fromiter((r.n for r in batch), np.int64, len(batch))
    d = draw(logits, batch, index)
    _, failed = d.resolve(batch)
    return d.tokens, failed


def route_step(
    router: Router, out: ForwardOutput, batch: Sequence[Request], drawn: Draw | None = None
) -> tuple[list[int], list[bool], Failed]:
    """One small-model step's tokens, the router's escalate answers and the rows that could
    not be sampled (drawn: the step's draw, made when it was launched; None: drawn here for
    each request's next place). A router may answer with a bool tensor, a numpy array or a
    list, one entry per request."""
    if drawn is None:
        drawn = draw(out.logits, batch, np.fromiter((r.n for r in batch), np.int64, len(batch)))
    feats = RouterFeatures(
        logits=out.logits,
        hidden=out.hidden,
        tokens=drawn.tokens,
        positions=torch.tensor([r.num_generated for r in batch], dtype=torch.int64),
        rids=torch.tensor([r.route_key for r in batch], dtype=torch.int64),
    )
    answer = router.route(feats)
    if isinstance(answer, torch.Tensor):
        answer = answer.detach().cpu()
    arr = np.asarray(answer)
    if arr.dtype.kind not in "biu":
        raise TypeError(f"router answered {type(answer).__name__} of {arr.dtype}, not booleans")
    decisions = arr.astype(bool).reshape(-1)
    if decisions.size != len(batch):
        raise ValueError(f"router answered {decisions.size} decisions for {len(batch)} requests")
    tokens, failed = drawn.resolve(batch)
    return tokens, decisions.tolist(), failed
