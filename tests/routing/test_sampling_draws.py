"""The counter-based sampler draw by draw: row i's token is the inverse CDF of
softmax((l - max) / T) in its top_p nucleus at uniform(seed, index[i]) (rng.py), exactly; a
request's draws along its own sequence (one seed, successive places) follow that law; index
defaults to each request's next place; a masked token is never drawn, even at the ends of
[0, 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from routing_helpers import VOCAB

from tokencache_routing import SamplingParams
from tokencache_routing.core.rng import uniforms
from tokencache_routing.core.sampling import _draw, draw, sample
from tokencache_routing.core.state import MAX_SEED, Request

LOGITS = torch.tensor([2.0, 1.4, 0.9, 0.5, 0.0, -0.6, -1.1, -3.0])


def request(sp: SamplingParams, rid: int = 0, prompt: int = 1) -> Request:
    return Request(rid, rid, np.arange(1, prompt + 1), 4, sp, frozenset())


def law(logits: torch.Tensor, temperature: float, top_p: float) -> np.ndarray:
    """softmax(l / T) in the nucleus (the most likely tokens while the mass before each is
    below top_p, ties in vocabulary order), renormalised, in float64."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p >= 1:
        return p.numpy()
    ps, order = p.sort(descending=True, stable=True)
    keep = ps.cumsum(0) - ps < top_p
    out = torch.zeros_like(p)
    out[order[keep]] = ps[keep]
    return (out / out.sum()).numpy()


def inverse_cdf(logits: torch.Tensor, temperature: float, top_p: float, u: float) -> int:
    """The reference draw: the first token, in vocabulary order without a nucleus and in
    probability order with one, whose cumulative mass exceeds u."""
    p = law(logits, temperature, top_p)
    order = np.arange(len(p)) if top_p >= 1 else np.argsort(-p, kind="stable")
    cdf = np.cumsum(p[order])
    return int(order[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(p) - 1)])


def test_each_draw_is_the_inverse_cdf_of_its_uniform() -> None:
    """300 rows of random logits, mixed temperatures and nuclei, seeds and places: every token
    is the reference's at uniform(seed, index) (a wrong uniform, place, temperature, nucleus
    or order changes some of them)."""
    g = torch.Generator().manual_seed(3)
    n = 300
    logits = torch.randn(n, VOCAB, generator=g) * 2.5
    temps = [0.3, 0.7, 1.0, 1.6]
    tops = [1.0, 0.9, 0.6, 0.3]
    params = [SamplingParams(temps[i % 4], tops[(i // 4) % 4], seed=1000 + 7 * i) for i in range(n)]
    batch = [request(sp, rid=i) for i, sp in enumerate(params)]
    index = np.random.default_rng(3).integers(0, 5000, n)
    tok, failed = sample(logits, batch, index)
    assert not failed
    u = uniforms(np.array([sp.seed for sp in params], np.uint64), index)
    want = [
        inverse_cdf(logits[i], sp.temperature, sp.top_p, float(u[i])) for i, sp in enumerate(params)
    ]
    assert tok.tolist() == want


@pytest.mark.parametrize("temperature,top_p", [(0.5, 1.0), (2.0, 1.0), (0.8, 0.7)])
def test_one_requests_draws_along_its_sequence_follow_the_law(
    temperature: float, top_p: float
) -> None:
    """One seed, 4000 successive places (the tokens of one long request): the histogram fits
    the law as well as 4000 seeds do (chi-square at p = 1e-4; nothing outside the nucleus), so
    the place is part of the draw and a request does not repeat one token."""
    n = 4000
    req = request(SamplingParams(temperature, top_p, seed=2024))
    tok, failed = sample(LOGITS.expand(n, -1), [req] * n, np.arange(n) + 1)
    assert not failed
    counts = np.bincount(tok.numpy(), minlength=len(LOGITS))
    expected = law(LOGITS, temperature, top_p)
    inside = expected > 0
    assert counts[~inside].sum() == 0, counts
    e = expected[inside] * n
    chi2 = float(((counts[inside] - e) ** 2 / e).sum())
    crit = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
    assert chi2 < crit[int(inside.sum()) - 1], (counts, e)


def test_index_defaults_to_each_requests_next_place() -> None:
    """sample() without index draws at r.n (prompt length plus tokens so far), per request:
    the same tokens as the index given explicitly, and other tokens at other places."""
    n = 64
    batch = [request(SamplingParams(1.0, seed=s), rid=s, prompt=1 + s % 5) for s in range(n)]
    for k, r in enumerate(batch):
        r.n += k % 3  # some generated tokens already
    places = np.array([r.n for r in batch])
    assert len(set(places.tolist())) > 3
    logits = LOGITS.expand(n, -1)
    default, failed = sample(logits, batch)
    assert not failed
    assert default.tolist() == sample(logits, batch, places)[0].tolist()
    u = uniforms(np.array([r.seed for r in batch], np.uint64), places)
    assert default.tolist() == [inverse_cdf(LOGITS, 1.0, 1.0, float(x)) for x in u]
    assert default.tolist() != sample(logits, batch, places + 1)[0].tolist()


@pytest.mark.parametrize("top_p", [None, 0.7])
def test_masked_tokens_are_never_drawn_at_the_ends_of_the_unit_interval(
    top_p: float | None,
) -> None:
    """u = 0 and u just below 1 against rows whose first and last tokens are masked (-inf):
    the draw lands on the first resp. last token with mass, never on a masked one."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 1.0, 0.5, 0.2, inf], [inf, inf, 0.0, 0.0, inf]])
    temp = torch.tensor([1.0, 1.0])
    tp = None if top_p is None else torch.tensor([top_p, top_p])
    lo, ok = _draw(logits, temp, tp, torch.tensor([0.0, 0.0], dtype=torch.float64))
    hi, _ = _draw(logits, temp, tp, torch.tensor([1 - 2.0**-53] * 2, dtype=torch.float64))
    assert ok.tolist() == [True, True]
    if top_p is None:  # vocabulary order
        assert lo.tolist() == [1, 2] and hi.tolist() == [3, 3]
    else:  # probability order (ties in vocabulary order); 0.7 keeps 1, 2 of row 0
        assert lo.tolist() == [1, 2] and hi.tolist() == [2, 3]


def test_draw_is_lazy_and_resolves_once() -> None:
    """draw() hands back device tokens at once; resolve() gives the host tokens and failures,
    the same as sample(), and can be asked again."""
    batch = [request(SamplingParams(0.9, 0.8, seed=s), rid=s) for s in range(6)]
    batch.insert(2, request(SamplingParams(), rid=99))  # greedy
    logits = LOGITS.expand(len(batch), -1).clone()
    logits[4, 3] = float("nan")
    index = np.arange(len(batch)) + 3
    d = draw(logits, batch, index)
    tokens, failed = d.resolve(batch)
    assert list(failed) == [4] and isinstance(failed[4], FloatingPointError)
    assert tokens[2] == 0
    again, failed_again = d.resolve(batch)
    assert again == tokens and list(failed_again) == [4]
    expect, _ = sample(logits, batch, index)
    assert expect.tolist() == tokens == d.tokens.tolist()


def test_batch_mates_of_a_seed_that_does_not_fit_draw_as_without_it() -> None:
    """Seeds past SamplingParams' validation: outside [0, 2**64) fails that row alone (an
    OverflowError); every other 64-bit seed, 0 and those above 2**63 among them, draws what
    it draws in a batch without the bad rows, bit for bit (its uniform from the exact seed)."""
    seeds = [2**64, 0, 7, 300, MAX_SEED, 2**63 + 12345, -1, 2**64 - 1, 2**63 + 1]
    batch = []
    for i, s in enumerate(seeds):
        r = request(SamplingParams(1.0, seed=1), rid=i)
        object.__setattr__(r.sampling, "seed", s)
        batch.append(r)
    logits = torch.zeros(len(seeds), VOCAB)  # uniform: the token is floor(u * VOCAB)
    index = np.arange(len(seeds)) + 10
    tok, failed = sample(logits, batch, index)
    assert sorted(failed) == [0, 6]
    assert all(isinstance(e, OverflowError) for e in failed.values())
    good = [i for i in range(len(seeds)) if i not in failed]
    alone, none = sample(logits[good], [batch[i] for i in good], index[good])
    assert not none and tok[good].tolist() == alone.tolist()
    u = uniforms(np.array([seeds[i] for i in good], np.uint64), index[good])
    assert alone.tolist() == [int(x * VOCAB) for x in u]


def test_tied_probabilities_stay_in_vocabulary_order_in_the_nucleus() -> None:
    """Ties are common (half-precision logits): the nucleus sort is stable, so tied tokens
    keep their vocabulary order. On VOCAB equal logits, top_p 0.5 keeps exactly the first
    half, and a nucleus that keeps every token draws what no nucleus draws, token for token
    (an unstable sort, as torch's default is on CPU for rows of this size, breaks both)."""
    n = 400
    logits = torch.zeros(n, VOCAB)
    index = np.arange(n) % 7
    half = [request(SamplingParams(1.0, 0.5, seed=s), rid=s) for s in range(n)]
    tok, failed = sample(logits, half, index)
    assert not failed and max(tok.tolist()) == VOCAB // 2 - 1 and len(set(tok.tolist())) > 40
    every = [request(SamplingParams(1.0, 0.999, seed=s), rid=s) for s in range(n)]
    plain = [request(SamplingParams(1.0, 1.0, seed=s), rid=s) for s in range(n)]
    a, _ = sample(logits, every, index)
    b, _ = sample(logits, plain, index)
    assert a.tolist() == b.tolist()


def test_the_uniform_is_used_at_full_precision() -> None:
    """uniform(1414446, 5) = 0.2395833349: 23.0000001 / 96, but 22.9999995 / 96 once rounded
    to float32 (found by a search over 2 million seeds): on 96 equal logits, with and without
    a nucleus, the draw is token 23, the float64 inverse CDF, not 22."""
    u = float(uniforms(np.array([1414446], np.uint64), np.array([5]))[0])
    assert int(u * VOCAB) == 23 and int(float(np.float32(u)) * VOCAB) == 22
    batch = [request(SamplingParams(1.0, top_p, seed=1414446)) for top_p in (1.0, 0.999)]
    tok, failed = sample(torch.zeros(2, VOCAB), batch, np.array([5, 5]))
    assert not failed and tok.tolist() == [23, 23]


def test_a_uniform_just_below_one_never_draws_a_masked_token() -> None:
    """uniform(14790804, 0) = 1 - 1.6e-8, which float32 rounds to 1.0 (one uniform in 2**25):
    the draw must still land on the last token with mass, never on the masked last token nor
    outside the nucleus (the uniforms once went to the device as float32: token 3 here)."""
    u = float(uniforms(np.array([14790804], np.uint64), np.array([0]))[0])
    assert u < 1.0 and float(np.float32(u)) == 1.0
    inf = float("-inf")
    logits = torch.tensor([[0.0, 1.0, 2.0, inf]] * 3)
    batch = [request(SamplingParams(1.0, tp, seed=14790804)) for tp in (1.0, 0.999, 0.5)]
    tok, failed = sample(logits, batch, np.zeros(3, np.int64))
    # Vocabulary order: the last token with mass is 2; probability order: 0, then 2 alone.
    assert not failed and tok.tolist() == [2, 0, 2]


def test_a_batch_whose_every_sampled_row_fails_its_seed() -> None:
    """No sampled row left to draw: each fails alone, the greedy row still gets its argmax."""
    batch = [request(SamplingParams(1.0, tp, seed=1), rid=i) for i, tp in enumerate((1.0, 0.5))]
    for r, s in zip(batch, (2**64, -3), strict=True):
        object.__setattr__(r.sampling, "seed", s)
    batch.append(request(SamplingParams(), rid=2))
    tok, failed = sample(LOGITS.expand(3, -1), batch, np.arange(3))
    assert sorted(failed) == [0, 1] and tok[2] == 0


def test_a_non_finite_row_is_reported_in_either_group() -> None:
    """Rows without and with a nucleus are drawn as two groups: a NaN row in the second is
    reported even when the first is clean (and in the first when the second is clean)."""
    sp = [SamplingParams(1.0, 1.0, seed=1), SamplingParams(1.0, 0.8, seed=2)] * 2
    batch = [request(p, rid=i) for i, p in enumerate(sp)]
    for bad in (3, 2):  # a nucleus row, then a plain one
        logits = LOGITS.expand(4, -1).clone()
        logits[bad, 1] = float("nan")
        _, failed = sample(logits, batch, np.arange(4))
        assert list(failed) == [bad] and isinstance(failed[bad], FloatingPointError)
