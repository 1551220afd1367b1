"""rng.py, the sampler's and BernoulliRouter's randomness: SplitMix64 as published (a seeded
request draws the same tokens in every release, and as any other SplitMix64 would), the top
53 bits as a uniform in [0, 1), and uniform(seed, counter) uniform and uncorrelated over
seeds and counters."""

from __future__ import annotations

import warnings

import numpy as np

from tokencache_routing.core.rng import splitmix64, to_unit, uniforms

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def reference(x: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014; Vigna's splitmix64.c), over
    Python ints: apart from the numpy code under test."""
    x = (x + GOLDEN) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


EDGES = [0, 1, 2, 3, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, MASK - GOLDEN, MASK - 1, MASK]


def test_reference_is_splitmix64() -> None:
    """The reference itself against SplitMix64's published outputs: the first of state 0,
    and the first five of seed 1234567 (the stream adds the golden gamma per output)."""
    assert reference(0) == 0xE220A8397B1DCDAF
    stream = [reference((1234567 + k * GOLDEN) & MASK) for k in range(5)]
    assert stream == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


def test_splitmix64_matches_the_reference() -> None:
    """Every bit, on edge values (wrapping at 2**64) and on 2000 spread ones."""
    spread = np.random.default_rng(7).integers(0, MASK, 2000, dtype=np.uint64, endpoint=True)
    xs = [*EDGES, *(int(v) for v in spread)]
    got = splitmix64(np.array(xs, dtype=np.uint64))
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [reference(x) for x in xs]
    # Signed input is reinterpreted as uint64, as the callers' int64 counters are.
    assert int(splitmix64(np.array([-1], dtype=np.int64))[0]) == reference(MASK)


def test_splitmix64_wraps_silently_on_numpy_scalars() -> None:
    """uint64 arithmetic wraps by design: no overflow warning even where numpy checks (its
    scalars and 0-d arrays, unlike arrays), so a warnings-as-errors caller does not break."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in EDGES:
            assert int(splitmix64(np.uint64(x))) == reference(x)
            assert int(splitmix64(np.array(x, dtype=np.uint64))) == reference(x)


def test_to_unit_is_the_top_53_bits() -> None:
    """(x >> 11) / 2**53: 0 at the bottom, below 1 at the top, one ulp per step of 2**11."""
    x = np.array([0, (1 << 11) - 1, 1 << 11, 1 << 63, MASK], dtype=np.uint64)
    u = to_unit(x)
    assert u.dtype == np.float64
    assert u.tolist() == [0.0, 0.0, 2.0**-53, 0.5, 1.0 - 2.0**-53]
    assert float(to_unit(np.array([MASK], dtype=np.uint64))[0]) < 1.0


def test_uniforms_hash_the_seed_then_the_counter() -> None:
    """uniform(seed, counter) = to_unit(splitmix64(splitmix64(seed) ^ counter)), bit for bit
    (the sampler's draws of a seeded request are these numbers in every release)."""
    seeds = [0, 1, 42, (1 << 63) - 1, 12345678901234567]
    counters = [0, 1, 7, 4096, (1 << 40) + 3]
    s, c = np.meshgrid(np.array(seeds, np.uint64), np.array(counters, np.int64))
    got = uniforms(s.ravel(), c.ravel())
    want = [
        (reference(reference(int(a)) ^ int(b)) >> 11) / 2.0**53
        for a, b in zip(s.ravel(), c.ravel(), strict=True)
    ]
    assert got.tolist() == want


def test_uniforms_are_uniform_and_uncorrelated() -> None:
    """200 seeds x 500 counters: 20 equal bins within a chi-square bound (19 degrees of
    freedom, p = 1e-4: 49.7), mean and variance of U(0, 1), and no correlation between a
    request's consecutive counters nor between neighbouring seeds at one counter."""
    s, c = np.meshgrid(np.arange(200, dtype=np.uint64), np.arange(500, dtype=np.int64))
    u = uniforms(s.ravel(), c.ravel()).reshape(500, 200)  # [counter, seed]
    assert ((u >= 0) & (u < 1)).all()
    counts = np.bincount((u * 20).astype(int).ravel(), minlength=20)
    e = u.size / 20
    assert float(((counts - e) ** 2 / e).sum()) < 49.7, counts
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    # Standard error of a correlation over ~1e5 pairs: ~0.003; 0.02 is a wide margin.
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.02
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.02
