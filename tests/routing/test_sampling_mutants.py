"""draw() writes the sampled rows into a copy of the forward's greedy tokens, never into the
forward's own output (a runner may hand out a buffer it reuses)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from tokencache_routing import SamplingParams
from tokencache_routing.core.sampling import draw


def test_draw_leaves_the_forwards_greedy_tokens_unwritten() -> None:
    vocab = 16
    logits = torch.zeros(3, vocab)
    logits[:, 5] = 50.0  # every sampled draw lands on token 5
    greedy = torch.tensor([1, 2, 3])  # stands for the epilogue's argmax (not logits' own)
    batch = [SimpleNamespace(rid=i, seed=i, sampling=SamplingParams(1.0, seed=i)) for i in range(3)]
    sampled = np.array([False, True, True])
    d = draw(logits, batch, np.arange(3), sampled, greedy=greedy)
    tokens, failed = d.resolve(batch)
    assert not failed and tokens == [1, 5, 5]
    assert greedy.tolist() == [1, 2, 3]
