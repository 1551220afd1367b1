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
from typing import Any

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
        keep = p.cumsum(-1) - p < top_p[:, None]
        # The most likely token stays whatever top_p: one below float32's least (a valid
        # 5e-324) is 0 here, which would keep nothing and draw the least likely token.
        keep[:, 0] = True
        p = torch.where(keep, p, 0.0)
    cdf = p.double().cumsum(-1)
    target = u.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    j = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    tok = j if order is None else order.gather(-1, j)
    return tok.squeeze(-1), ok


class Readback:
    """Device tensors copied to the host without blocking: on CUDA into pinned memory on the
    current stream, with an event recorded after the copies, so reading them waits for the
    work that made them and not for what was queued behind it since (the next step, with
    overlap: a plain .tolist() there would wait for that step too and idle the device while
    the host finishes this one). Elsewhere the tensors themselves."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: Any = None
        self._out = list(tensors)
        if any(t.device.type == "cuda" for t in tensors):
            self._out = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in tensors
            ]
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()

    def get(self) -> list[torch.Tensor]:
        """The host copies (waits for them once)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._out


@dataclass
class Draw:
    """A batch's tokens drawn on the logits' device, their copy to the host under way."""

    tokens: torch.Tensor  # [B] int64, on the device
    # Per sampled group: its rows and whether each row's logits were finite (on the device).
    checks: list[tuple[list[int], torch.Tensor]]
    failed: Failed  # rows that failed on the host (their seed)
    readback: Readback | None = None

    def __post_init__(self) -> None:
        self.readback = Readback([self.tokens, *(ok for _, ok in self.checks)])

    def resolve(self, batch: Sequence[Request]) -> tuple[list[int], Failed]:
        """The tokens on the host and every row that could not be sampled (a sync point:
        waits for this step's draw only)."""
        assert self.readback is not None
        tokens, *oks = self.readback.get()
        failed = dict(self.failed)
        for (idx, _), ok in zip(self.checks, oks, strict=True):
            if bool(ok.all()):
                continue
            for k in torch.nonzero(~ok).flatten().tolist():
                r = batch[idx[k]]
                failed[idx[k]] = FloatingPointError(
                    f"request {r.rid}: its logits are not finite (NaN or inf), cannot sample"
                )
        return tokens.tolist(), failed


def draw(
    logits: torch.Tensor,
    batch: Sequence[Request],
    index: np.ndarray,
    sampled: np.ndarray | None = None,
    greedy: torch.Tensor | None = None,
) -> Draw:
    """Next token per row, as device work: argmax for greedy requests, else a draw from
    softmax((l - max) / T) in the top_p nucleus with uniform(seed, index[i]), index[i] being
    the place of row i's token in its request's sequence. sampled: which rows are not greedy,
    when the caller knows (RowFacts), else read from each request. greedy: the argmax when the
    forward's epilogue computed it (ForwardOutput.greedy), else computed here."""
    if sampled is None:
        rows = [i for i, r in enumerate(batch) if not r.sampling.greedy]
    else:
        rows = sampled.nonzero()[0].tolist()  # 1-d: np.flatnonzero's wrappers cost more
    # The sampled rows are written below: into a copy of the forward's greedy tokens.
    tok = logits.argmax(-1) if greedy is None else greedy.clone() if rows else greedy
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
        # float64: torch.tensor of Python floats would round the 53-bit uniforms to float32,
        # and one in 2**25 to 1.0, past the last token with mass (a masked one).
        u_idx = torch.tensor([us[i] for i in idx], dtype=torch.float64)
        drawn, ok = _draw(logits[sel], temp, top_p, u_idx)
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


class Decisions:
    """A router's escalate answers for one step, their copy to the host under way."""

    def __init__(self, answer: Any, rows: int) -> None:
        if isinstance(answer, torch.Tensor):
            if answer.dtype not in (torch.bool, torch.uint8, torch.int8, torch.int16,
                                    torch.int32, torch.int64):  # fmt: skip
                raise TypeError(f"router answered a tensor of {answer.dtype}, not booleans")
            if answer.numel() != rows:
                raise ValueError(f"router answered {answer.numel()} decisions for {rows} requests")
            flat = answer if answer.dim() == 1 else answer.reshape(-1)
            if flat.requires_grad:  # a learned router's answer: its graph is not kept
                flat = flat.detach()
            self._readback: Readback | None = Readback([flat])
            self._host: list[bool] | None = None
            return
        arr = np.asarray(answer)
        if arr.dtype.kind not in "biu":
            raise TypeError(f"router answered {type(answer).__name__} of {arr.dtype}, not booleans")
        if arr.size != rows:
            raise ValueError(f"router answered {arr.size} decisions for {rows} requests")
        self._readback = None
        self._host = arr.astype(bool).reshape(-1).tolist()

    def resolve(self) -> list[bool]:
        if self._host is None:
            assert self._readback is not None
            (t,) = self._readback.get()
            self._host = t.to(torch.bool).tolist()
        return self._host


def route(
    router: Router,
    out: ForwardOutput,
    batch: Sequence[Request],
    tokens: torch.Tensor,
    index: np.ndarray,
    prompt_len: np.ndarray | None = None,
    route_key: np.ndarray | None = None,
) -> Decisions:
    """The router over one small step's output and drawn tokens, as device work where the
    router's is (index: the place of each row's token in its request, so its generated
    position is index - prompt length even for a row continuing a step not finished yet;
    prompt_len / route_key: the requests', when the caller has them as arrays). A router may
    answer with a bool tensor, a numpy array or a list, one entry per request. Where the
    forward's epilogue computed the answer (Router.device_threshold of the router the forward
    was prepared with: the caller's, as launch() does), that is it: nothing is built or
    launched here."""
    n = len(batch)
    if out.escalate is not None:
        return Decisions(out.escalate, n)
    if prompt_len is None:
        prompt_len = np.fromiter((r.prompt_len for r in batch), np.int64, n)
    if route_key is None:
        route_key = np.fromiter((r.route_key for r in batch), np.int64, n)
    feats = RouterFeatures(  # positions and rids: tensors once a router reads them
        logits=out.logits,
        hidden=out.hidden,
        tokens=tokens,
        positions=np.asarray(index, np.int64) - prompt_len,
        rids=np.array(route_key, np.int64),  # a copy: routers may keep it
    )
    if out.entropy is not None:  # computed by the forward's epilogue
        feats._cache["entropy"] = out.entropy
    return Decisions(router.route(feats), len(batch))
