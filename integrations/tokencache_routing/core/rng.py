"""Counter-based randomness: a pure function of (seed, counter), so a draw never depends on
how many draws came before it. The router's Bernoulli decisions and the sampler's uniforms
use it: a request's token at sequence index i is drawn with uniform(seed, i) whichever batch,
step or schedule computes it (an overlapped step that computes a row it later drops consumes
nothing), and after a preemption the same draws replay. SGLang's seeded sampling hashes
(seed, position) the same way."""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function over uint64 (elementwise, wrapping arithmetic)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


def to_unit(x: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniforms in [0, 1) (the top 53 bits)."""
    out: np.ndarray = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return out


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per (seed, counter) pair, both uint64-representable."""
    return to_unit(splitmix64(splitmix64(seeds) ^ counters.astype(np.uint64)))
