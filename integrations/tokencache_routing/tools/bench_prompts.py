"""The routing benchmark's prompts: K system prompts, each shared by every K-th request, plus
each request's own tokens; and the longest prefix two of them share (the most KV two requests'
rows can read once)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def make_prompts(
    n: int, shared: int, unique: int, vocab: int, seed: int, system_prompts: int = 1
) -> list[list[int]]:
    """n prompts: prompt i is system prompt i mod system_prompts (each `shared` random tokens)
    plus `unique` of its own. The system prompts are drawn first, so one prompt gives the
    same prompts whatever the count (K=1 is the historical workload, bit for bit)."""
    if system_prompts < 1:
        raise ValueError(f"system_prompts must be >= 1, got {system_prompts}")
    rng = __import__("numpy").random.default_rng(seed)
    bases = [rng.integers(0, vocab, shared).tolist() for _ in range(system_prompts)]
    return [bases[i % system_prompts] + rng.integers(0, vocab, unique).tolist() for i in range(n)]


def system_prompts_of(prompts: Sequence[Sequence[int]], shared: int) -> list[list[int]]:
    """The distinct `shared`-token system prompts of prompts, in order of first use."""
    return [list(s) for s in dict.fromkeys(tuple(q[:shared]) for q in prompts)]


def longest_common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """The longest prefix two of seqs (different entries) have in common: the most KV slots two
    requests' rows can share (equal slots hold equal tokens). The adjacent pairs in sorted
    order include the best pair."""
    import numpy as np

    best = 0
    for x, y in itertools.pairwise(sorted(tuple(q) for q in seqs)):
        m = min(len(x), len(y))
        diff = np.flatnonzero(np.asarray(x[:m]) != np.asarray(y[:m]))
        best = max(best, int(diff[0]) if len(diff) else m)
    return best
