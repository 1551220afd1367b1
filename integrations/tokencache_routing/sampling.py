"""Per-row token choice of a decode step: sampling, and the router's escalation answers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokencache_models import ForwardOutput

from .routers import Router, RouterFeatures
from .state import Request


def sample(logits: torch.Tensor, batch: Sequence[Request]) -> torch.Tensor:
    """Next token per row: argmax for greedy requests, else a draw from the request's own
    seeded generator (temperature, then the top_p nucleus)."""
    tok = logits.argmax(-1)
    for i, r in enumerate(batch):
        sp = r.sampling
        if sp.greedy:
            continue
        if r.generator is None:
            r.generator = torch.Generator(device="cpu")
            seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)))
            r.generator.manual_seed(seed)
        probs = torch.softmax(logits[i].float().cpu() / sp.temperature, dim=-1)
        if sp.top_p < 1:
            p_sorted, order = probs.sort(descending=True)
            keep = p_sorted.cumsum(0) - p_sorted < sp.top_p  # the top token always stays
            probs = torch.zeros_like(probs).scatter(0, order[keep], p_sorted[keep])
        tok[i] = torch.multinomial(probs, 1, generator=r.generator).to(tok.device)[0]
    return tok


def route_step(
    router: Router, out: ForwardOutput, batch: Sequence[Request]
) -> tuple[torch.Tensor, list[bool]]:
    """One small-model step's tokens and the router's escalate answers. A router may answer
    with a bool tensor, a numpy array or a list, one entry per request."""
    tok = sample(out.logits, batch)
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
    return tok, decisions.tolist()
