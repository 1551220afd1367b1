"""What a forward computes from its logits on the device, after the head: each row's greedy
token and, for an entropy router, each row's entropy and the router's answer.

Done by the host after the forward, these are a handful of separate kernels per step, each
launched by Python (on this CPU, computed by the host thread itself); done here they are part
of the forward's device work: inside its CUDA graph on the decode path, so a step's host
pays nothing for them. The values are the ones the host-side code computes (same operations
on the same logits): greedy = argmax over the first `vocab` logits (a model's padding columns
are never drawn), entropy = -sum(p * log p) over them in float32, as RouterFeatures.entropy,
and escalate = entropy >= the router's threshold, the comparison EntropyRouter.route makes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .context import ForwardOutput


def entropy_of(log_probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each row of log-probabilities: the one formula the
    epilogue and the router's host-side features (RouterFeatures.entropy) both use."""
    return -(log_probs.exp() * log_probs).sum(-1)


@dataclass(frozen=True)
class Epilogue:
    """vocab: the logits columns that are tokens (the engine's shared vocabulary); entropy:
    compute each row's entropy too (a router reads it); escalate_at: and the router's answer,
    escalate = entropy >= escalate_at (a router whose whole answer that is: no host op, no
    features built for it after the step)."""

    vocab: int
    entropy: bool = False
    escalate_at: float | None = None

    def __post_init__(self) -> None:
        if self.vocab < 1:
            raise ValueError(f"Epilogue.vocab must be >= 1, got {self.vocab}")
        if self.escalate_at is not None and not self.entropy:
            raise ValueError("Epilogue.escalate_at compares the entropy: it needs entropy=True")

    def apply(self, out: ForwardOutput) -> ForwardOutput:
        """out with greedy (and entropy) set; device work only (capturable in a graph)."""
        logits = out.logits
        if logits.shape[-1] < self.vocab:
            raise ValueError(
                f"Epilogue over {self.vocab} tokens, but the logits have {logits.shape[-1]}"
            )
        if logits.shape[-1] > self.vocab:
            logits = logits[:, : self.vocab]
        greedy = logits.argmax(-1)
        entropy = escalate = None
        if self.entropy:
            entropy = entropy_of(torch.log_softmax(logits.float(), dim=-1))
            if self.escalate_at is not None:
                escalate = entropy >= self.escalate_at
        return dataclasses.replace(out, greedy=greedy, entropy=entropy, escalate=escalate)
