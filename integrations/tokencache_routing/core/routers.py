"""Request-centric routers: per step, batch features in, a keep/escalate bool tensor out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokencache_models.forward.epilogue import entropy_of

from .rng import splitmix64, to_unit


def _as_tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A host array as a tensor sharing its memory (a tensor as it is)."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


class RouterFeatures:
    """What the small model saw at one step, for B requests (row i = request rids[i]).

    logits: [B, V] fp32 next-token logits of the small model; hidden: [B, H] final-norm hidden
    state of the last fed token; tokens: [B] int64 the small model's greedy token; positions:
    [B] int64 index of that token among the generated ones; rids: [B] int64 request ids.
    positions and rids may be given as numpy arrays (the engine's, kept on the host): they
    become tensors when a router first reads them, so a router that reads neither makes no
    tensor for them (each op of a step's host path costs microseconds)."""

    def __init__(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor | np.ndarray,
        rids: torch.Tensor | np.ndarray,
    ) -> None:
        self.logits = logits
        self.hidden = hidden
        self.tokens = tokens
        self._positions = positions
        self._rids = rids
        self._cache: dict[str, Any] = {}

    @property
    def positions(self) -> torch.Tensor:
        self._positions = p = _as_tensor(self._positions)
        return p

    @property
    def rids(self) -> torch.Tensor:
        self._rids = r = _as_tensor(self._rids)
        return r

    @property
    def log_probs(self) -> torch.Tensor:
        if "lp" not in self._cache:
            self._cache["lp"] = torch.log_softmax(self.logits.float(), dim=-1)
        lp: torch.Tensor = self._cache["lp"]
        return lp

    @property
    def entropy(self) -> torch.Tensor:
        """Shannon entropy in nats, [B] (the forward's epilogue may have computed it: the same
        operations, tokencache_models.Epilogue)."""
        if "entropy" not in self._cache:
            self._cache["entropy"] = entropy_of(self.log_probs)
        h: torch.Tensor = self._cache["entropy"]
        return h

    @property
    def top1_prob(self) -> torch.Tensor:
        return self.log_probs.max(-1).values.exp()

    def topk_logits(self, k: int) -> torch.Tensor:
        """[B, k] largest logits in descending order (k capped at the vocabulary)."""
        return self.logits.topk(min(k, self.logits.shape[-1]), dim=-1).values


class Router:
    """route(features) -> [B] bool, True = escalate this token to the large model.

    device_features: the RouterFeatures a router reads that the forward can compute on the
    device, in its epilogue (tokencache_models.Epilogue: "entropy"), so the host does not
    launch them after each step. Subclasses inherit it (an EntropyRouter subclass gets the
    entropy computed whether it reads it or not); a router wrapping another declares its
    inner router's to keep them; a router without the attribute gets none (computed on the
    host when read)."""

    device_features: frozenset[str] = frozenset()

    def route(self, f: RouterFeatures) -> torch.Tensor:
        raise NotImplementedError

    def device_threshold(self) -> float | None:
        """t when this router's whole answer is entropy >= t, which the forward's epilogue
        then computes on the device (Epilogue.escalate_at) instead of a route() call after
        the step; else None (route() answers)."""
        return None


class EntropyRouter(Router):
    """Escalate when the small model's entropy is at or above a threshold (R2R baseline 0.45)."""

    device_features = frozenset({"entropy"})

    def __init__(self, threshold: float = 0.45) -> None:
        self.threshold = threshold

    def route(self, f: RouterFeatures) -> torch.Tensor:
        return f.entropy >= self.threshold

    def device_threshold(self) -> float | None:
        # A subclass routing otherwise (its own route) answers itself; so does a threshold
        # that is no plain number (a tensor: no graph key) or NaN (a key equal to no other).
        t = self.threshold
        if type(self).route is not EntropyRouter.route:
            return None
        if not isinstance(t, float | int) or isinstance(t, bool):
            return None
        return t if t == t else None


class Top1ProbRouter(Router):
    """Escalate when the small model's top-1 probability is below a threshold."""

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = threshold

    def route(self, f: RouterFeatures) -> torch.Tensor:
        return f.top1_prob < self.threshold


class BernoulliRouter(Router):
    """Escalate with probability p, deterministically in (seed, request id, position)."""

    def __init__(self, p: float, seed: int = 0) -> None:
        self.p = p
        self.seed = seed

    def decide(self, rids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            key = (
                np.uint64(self.seed) * np.uint64(0x100000001B3)
                ^ (rids.astype(np.uint64) << np.uint64(32))
                ^ positions.astype(np.uint64)
            )
        u = to_unit(splitmix64(key))
        escalate: np.ndarray = u < self.p
        return escalate

    def route(self, f: RouterFeatures) -> torch.Tensor:
        return torch.from_numpy(self.decide(f.rids.numpy(), f.positions.numpy()))


class ScriptedRouter(Router):
    """Escalate exactly at the given generated-token positions of each request (tests)."""

    def __init__(
        self,
        positions: Mapping[int, Sequence[int]] | None = None,
        default: Sequence[int] = (),
        every: bool = False,
    ) -> None:
        self.positions = {int(r): set(map(int, p)) for r, p in (positions or {}).items()}
        self.default = set(map(int, default))
        self.every = every

    def decide(self, rid: int, pos: int) -> bool:
        return self.every or pos in self.positions.get(rid, self.default)

    def route(self, f: RouterFeatures) -> torch.Tensor:
        pairs = zip(f.rids.tolist(), f.positions.tolist(), strict=True)
        out = [self.decide(r, p) for r, p in pairs]
        return torch.tensor(out, dtype=torch.bool)


class _Block(nn.Module):
    """Pre-LayerNorm residual MLP block (R2R r2r/models/router.py)."""

    def __init__(self, width: int, expansion: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width * expansion)
        self.fc2 = nn.Linear(width * expansion, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))
        return y


class NeuralRouter(nn.Module, Router):
    """R2R-style MLP over [hidden state, sampled token's embedding, projected top-k logits].

    The embedding table is a frozen copy of the small model's (a buffer, not saved with the
    weights). Escalate when sigmoid(score) >= threshold.
    """

    def __init__(
        self,
        hidden_size: int,
        embed_dim: int,
        top_k: int = 100,
        width: int = 256,
        num_blocks: int = 2,
        expansion: int = 4,
        threshold: float = 0.5,
        embedding: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = {
            "hidden_size": hidden_size,
            "embed_dim": embed_dim,
            "top_k": top_k,
            "width": width,
            "num_blocks": num_blocks,
            "expansion": expansion,
        }
        self.top_k = top_k
        self.threshold = threshold
        self.topk_proj = nn.Linear(top_k, hidden_size)
        self.inp = nn.Linear(2 * hidden_size + embed_dim, width)
        self.blocks = nn.ModuleList(_Block(width, expansion) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 1)
        self.embedding: torch.Tensor | None
        self.register_buffer(
            "embedding", None if embedding is None else embedding.detach().clone(), False
        )

    def forward(
        self, hidden: torch.Tensor, token_emb: torch.Tensor, topk_logits: torch.Tensor
    ) -> torch.Tensor:
        """Escalation score logits, [B]."""
        if topk_logits.shape[-1] < self.top_k:  # tiny vocabularies: pad with the minimum
            pad = topk_logits[:, -1:].expand(-1, self.top_k - topk_logits.shape[-1])
            topk_logits = torch.cat((topk_logits, pad), -1)
        x = torch.cat((hidden, token_emb, self.topk_proj(topk_logits)), -1)
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        score: torch.Tensor = self.out(self.norm(x)).squeeze(-1)
        return score

    @torch.no_grad()
    def route(self, f: RouterFeatures) -> torch.Tensor:
        if self.embedding is None:
            raise ValueError("NeuralRouter needs the small model's embedding table to route")
        emb = self.embedding[f.tokens.to(self.embedding.device)].float()
        score = self.forward(f.hidden.float(), emb, f.topk_logits(self.top_k).float())
        return torch.sigmoid(score).cpu() >= self.threshold

    def save(self, path: str | Path) -> None:
        sd = {k: v for k, v in self.state_dict().items() if k != "embedding"}
        torch.save({"config": self.config, "threshold": self.threshold, "state_dict": sd}, path)

    @classmethod
    def load(
        cls,
        path: str | Path,
        embedding: torch.Tensor | None = None,
        threshold: float | None = None,
    ) -> NeuralRouter:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        thr = ckpt["threshold"] if threshold is None else threshold
        router = cls(**ckpt["config"], threshold=thr, embedding=embedding)
        router.load_state_dict(ckpt["state_dict"], strict=False)
        return router.eval()
