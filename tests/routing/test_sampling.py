"""sample() draws from softmax((l - max) / T) in the top_p nucleus, row by row whatever the
batch; SamplingParams refuses what it cannot sample; a row that cannot be sampled ends its own
request alone (every dispatch, both drivers)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch
from routing_helpers import VOCAB, make_prompts

from tokencache_models import ForwardOutput
from tokencache_routing import EngineConfig, RoutedEngine, SamplingParams, ScriptedRouter
from tokencache_routing.core.routers import Router, RouterFeatures
from tokencache_routing.core.sampling import Decisions, Readback, route, sample
from tokencache_routing.core.state import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE, Request

LOGITS = torch.tensor([2.0, 1.4, 0.9, 0.5, 0.0, -0.6, -1.1, -3.0])


def requests(params: list[SamplingParams]) -> list[Request]:
    return [Request(i, i, np.array([1]), 4, sp, frozenset()) for i, sp in enumerate(params)]


def nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: the most likely tokens while the mass before each is below top_p,
    renormalised (computed in float64, apart from the code under test)."""
    ps, order = p.sort(descending=True)
    keep = ps.cumsum(0) - ps < top_p
    out = torch.zeros_like(p)
    out[order[keep]] = ps[keep]
    return out / out.sum()


def chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    inside = expected > 0
    assert counts[~inside].sum() == 0, f"drew outside the nucleus: {counts}"
    e = expected[inside] * counts.sum()
    return float((((counts[inside] - e) ** 2) / e).sum())


# chi-square critical values at p = 1e-4 by degrees of freedom (the seeds are fixed, so the
# test is deterministic; the bound only says how far from the law a pass may be)
CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
N = 4000


@pytest.mark.parametrize(
    "temperature,top_p", [(1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (0.7, 0.8), (1.5, 0.6), (1.0, 0.95)]
)
def test_draws_follow_softmax_over_temperature_in_the_nucleus(
    temperature: float, top_p: float
) -> None:
    """N requests, seeds base..base+N, one draw each from the same logits: the histogram fits
    softmax(l / T) restricted to the nucleus (a temperature applied inverted, or a nucleus one
    token too wide or too narrow, is off by hundreds)."""
    base = int(temperature * 1000 + top_p * 100) * N
    params = [SamplingParams(temperature, top_p, seed=base + s) for s in range(N)]
    tok, failed = sample(LOGITS.expand(N, -1), requests(params))
    assert not failed
    counts = np.bincount(tok.numpy(), minlength=len(LOGITS))
    expected = nucleus(torch.softmax(LOGITS.double() / temperature, 0), top_p).numpy()
    # No nucleus boundary within float32 noise of top_p (the reference would be ambiguous).
    ps = torch.softmax(LOGITS.double() / temperature, 0).sort(descending=True).values
    assert top_p == 1 or (ps.cumsum(0)[:-1] - top_p).abs().min() > 1e-3
    k = int((expected > 0).sum())
    if k > 1:
        assert chi_square(counts, expected) < CRIT[k - 1], (counts, expected * N)
    else:
        assert counts[int(expected.argmax())] == N
    # The total-variation distance agrees: within a few sampling standard errors.
    assert 0.5 * np.abs(counts / N - expected).sum() < 0.04


def test_a_rows_draw_does_not_depend_on_its_batch() -> None:
    """Greedy and sampled rows, with and without a nucleus, mixed in one batch: each row gets
    the token it gets alone (same seed), and greedy rows the argmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, VOCAB, generator=g) * 3
    params = [
        SamplingParams(),
        SamplingParams(1.0, seed=1),
        SamplingParams(0.7, 0.9, seed=2),
        SamplingParams(MIN_TEMPERATURE / 10, seed=3),  # below the minimum: greedy
        SamplingParams(1.3, 0.5, seed=4),
        SamplingParams(2.0, seed=5),
    ] * 2
    together, failed = sample(logits, requests(params))
    assert not failed
    alone = [int(sample(logits[i : i + 1], requests([sp]))[0][0]) for i, sp in enumerate(params)]
    assert together.tolist() == alone
    for i in (0, 3, 6, 9):
        assert alone[i] == int(logits[i].argmax())


def test_extreme_temperatures_stay_finite() -> None:
    """The smallest temperature sampled (MIN_TEMPERATURE) on wide logits, and the largest on
    rows with masked (-inf) logits: finite draws, the argmax resp. never a masked token."""
    logits = torch.tensor([[30.0, 29.0, -50.0, 0.0], [1.0, float("-inf"), 2.0, float("-inf")]])
    # Logits / T past float32's range unless the max is subtracted first.
    huge = torch.tensor([[1e34, 3e34, -3e34, 2.99e34]])
    for s in range(50):
        lo = SamplingParams(MIN_TEMPERATURE, seed=s)
        hi = SamplingParams(MAX_TEMPERATURE, seed=s)
        tok, failed = sample(torch.cat([logits, huge]), requests([lo, hi, lo]))
        assert not failed
        assert tok[0] == 0 and tok[1] in (0, 2) and tok[2] == 1
    # Half precision logits as a GPU model hands them.
    tok, failed = sample(logits.half(), requests([lo, hi]))
    assert not failed and tok[0] == 0 and tok[1] in (0, 2)


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    params = [SamplingParams(1.0, seed=s) for s in range(4)]
    reqs = requests(params)
    bad = requests([SamplingParams(1.0, seed=9)])[0]
    object.__setattr__(bad.sampling, "seed", 2**64)  # past validation: the generator refuses
    tok, failed = sample(logits[[0, 1, 2, 3, 3]], [*reqs, bad])
    assert sorted(failed) == [1, 2, 4]
    assert isinstance(failed[1], FloatingPointError) and "not finite" in str(failed[1])
    clean = requests(params)
    expect, none = sample(logits[[0, 3]], [clean[0], clean[3]])
    assert not none and [int(tok[0]), int(tok[3])] == expect.tolist()


@pytest.mark.parametrize(
    "kw,error",
    [
        ({"temperature": -0.1}, ValueError),
        ({"temperature": float("nan")}, ValueError),
        ({"temperature": float("inf")}, ValueError),
        ({"temperature": MAX_TEMPERATURE * 2}, ValueError),
        ({"temperature": "1"}, ValueError),
        ({"temperature": True}, ValueError),
        ({"top_p": 0}, ValueError),
        ({"top_p": 1.01}, ValueError),
        ({"top_p": float("nan")}, ValueError),
        ({"seed": -1}, ValueError),
        ({"seed": MAX_SEED + 1}, ValueError),
        ({"seed": 2**64}, ValueError),
        ({"seed": 1.0}, TypeError),
        ({"seed": True}, TypeError),
    ],
)
def test_sampling_params_refuse_what_cannot_be_sampled(kw: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        SamplingParams(**{"temperature": 1.0, **kw})


def test_sampling_params_edges_accepted() -> None:
    assert SamplingParams(1e-40).greedy and SamplingParams(0).greedy  # no underflow: argmax
    assert not SamplingParams(MIN_TEMPERATURE).greedy
    top = SamplingParams(1.0, seed=MAX_SEED)
    assert top.seed == MAX_SEED
    _, failed = sample(LOGITS[None], requests([top]))
    assert not failed
    sp = SamplingParams(np.float64(0.5), np.float32(0.5), seed=np.int64(3))
    assert (type(sp.temperature), type(sp.top_p), type(sp.seed)) == (float, float, int)


# ---------------------------------------------------------------- engine: one bad row


def _run(pair: Any, dispatch: str, mode: str, which: str, bad: bool) -> list[Any]:
    # Request 1 is sampled; escalated at position 0 its first draw is in a catch-up.
    router = ScriptedRouter({1: [0, 3] if which == "large" else [3], 2: [1, 2]})
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, dispatch=dispatch, mode=mode)
    )
    prompts = make_prompts(4, seed=90, lo=3, hi=6)
    params = [SamplingParams(1.2, 0.9, seed=11), SamplingParams(1.0, seed=12), None]
    params.append(SamplingParams(0.8, seed=13))
    handles = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        if bad and i == 1:
            assert sp is not None
            sp = dataclasses.replace(sp)
            object.__setattr__(sp, "seed", 2**64)  # what D1 sent, past SamplingParams
        handles.append(eng.submit(p, 8, sampling=sp, route_key=i))
    assert all(h.wait(60) for h in handles)
    # KV only: threaded workers that submit() started may still be exiting until shutdown.
    assert eng.idle_invariant()
    eng.shutdown()  # joins the workers: no thread outlives the test
    return handles


@pytest.mark.parametrize(
    "dispatch,mode", [("tokencache", "events"), ("naive", "events"), ("tokencache", "threaded")]
)
@pytest.mark.parametrize("which", ["small", "large"])
def test_one_bad_row_ends_its_request_alone(
    pair: Any, dispatch: str, mode: str, which: str
) -> None:
    clean = _run(pair, dispatch, mode, which, bad=False)
    faulty = _run(pair, dispatch, mode, which, bad=True)
    assert faulty[1].finished_reason == "error"
    assert "Overflow" in str(faulty[1].error)
    assert faulty[1].tokens == []  # its first draw failed
    for i in (0, 2, 3):
        assert faulty[i].finished_reason == clean[i].finished_reason == "length"
        assert (faulty[i].tokens, faulty[i].models) == (clean[i].tokens, clean[i].models)


def test_unseeded_requests_get_a_random_seed() -> None:
    """seed=None: each request draws its own seed once (then keeps it: its draws replay)."""
    reqs = requests([SamplingParams(1.0) for _ in range(200)])
    tok, failed = sample(LOGITS.expand(200, -1), reqs)
    assert not failed and len(set(tok.tolist())) > 3
    seeds = [r.seed for r in reqs]
    assert len(set(seeds)) == len(seeds)
    again, _ = sample(LOGITS.expand(200, -1), reqs)
    assert [r.seed for r in reqs] == seeds and torch.equal(again, tok)  # kept


def test_nucleus_boundary_is_exclusive() -> None:
    """The mass before a token must be below top_p for it to stay: two tied tokens of 0.5 at
    top_p 0.5 keep only the first in a stable sort (vocabulary order), as HF's top_p does;
    at 0.51 both stay."""
    logits = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")]).expand(400, -1)
    half = requests([SamplingParams(1.0, 0.5, seed=s) for s in range(400)])
    tok, failed = sample(logits, half)
    assert not failed and set(tok.tolist()) == {0}
    wider = requests([SamplingParams(1.0, 0.51, seed=s) for s in range(400)])
    tok, failed = sample(logits, wider)
    assert not failed and set(tok.tolist()) == {0, 1}


# ---------------------------------------------------------------- a router's answers


@pytest.mark.parametrize(
    "answer,resolved",
    [
        (torch.tensor([0, 1, 2, 255], dtype=torch.uint8), [False, True, True, True]),
        (torch.tensor([[True], [False], [True], [True]]), [True, False, True, True]),
        (np.array([0, 3, 0, 1], dtype=np.int64), [False, True, False, True]),
        (np.array([[1], [0], [0], [1]], dtype=np.uint8), [True, False, False, True]),
        ([False, True, 1, 0], [False, True, True, False]),
    ],
)
def test_router_answers_resolve_to_one_bool_per_row(answer: Any, resolved: list[bool]) -> None:
    """Integer answers are truth values: resolve() gives Python bools, one per row."""
    got = Decisions(answer, 4).resolve()
    assert got == resolved and all(type(b) is bool for b in got)


@pytest.mark.parametrize(
    "answer,error,message",
    [
        (torch.tensor([0.5, 0.1]), TypeError, r"router answered a tensor of torch\.float32"),
        (torch.tensor([True, False, True]), ValueError, "router answered 3 decisions for 2"),
        (np.array([0.5, 0.1]), TypeError, "router answered ndarray of float64"),
        ([True], ValueError, "router answered 1 decisions for 2"),
    ],
)
def test_router_answers_of_the_wrong_kind_or_count_are_refused(
    answer: Any, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        Decisions(answer, 2)


def test_route_hands_the_router_the_steps_features() -> None:
    """route(): the small step's logits and hidden states, the drawn tokens, each row's
    generated position (index - prompt length) and route key, as int64 tensors."""
    seen: list[RouterFeatures] = []

    class Capture(Router):
        def route(self, f: RouterFeatures) -> Any:
            seen.append(f)
            return [True, False, True]

    batch = [
        Request(i, 40 + i, np.arange(1, 2 + 2 * i), 4, SamplingParams(), frozenset())
        for i in range(3)
    ]  # prompts of 1, 3, 5 tokens
    out = ForwardOutput(torch.randn(3, VOCAB), torch.randn(3, 16))
    tokens = torch.tensor([5, 6, 7])
    d = route(Capture(), out, batch, tokens, np.array([1, 7, 5], np.int64))
    assert d.resolve() == [True, False, True]
    (f,) = seen
    assert f.logits is out.logits and f.hidden is out.hidden and f.tokens is tokens
    assert f.positions.dtype == torch.int64 and f.positions.tolist() == [0, 4, 0]
    assert f.rids.dtype == torch.int64 and f.rids.tolist() == [40, 41, 42]


def test_route_hands_the_router_the_epilogues_entropy() -> None:
    """The entropy the forward's epilogue computed is the one a router reads: the very
    tensor, not the same formula again over the logits (a marked value tells them apart)."""
    seen: list[torch.Tensor] = []

    class Capture(Router):
        def route(self, f: RouterFeatures) -> Any:
            seen.append(f.entropy)
            return [False, False]

    batch = [Request(i, i, np.arange(1, 4), 4, SamplingParams(), frozenset()) for i in range(2)]
    marked = torch.tensor([9.5, 9.25])  # no entropy of these logits (at most log VOCAB)
    out = ForwardOutput(torch.randn(2, VOCAB), torch.randn(2, 16), entropy=marked)
    route(Capture(), out, batch, torch.tensor([5, 6]), np.array([3, 3], np.int64))
    assert seen[0] is marked
    out = ForwardOutput(out.logits, out.hidden)  # no epilogue: the features compute it
    route(Capture(), out, batch, torch.tensor([5, 6]), np.array([3, 3], np.int64))
    assert seen[1].max() <= math.log(VOCAB) + 1e-4


def test_a_readback_waits_for_its_event_once() -> None:
    """Readback.get() synchronizes the copies' event the first time only (the CUDA path,
    with a stand-in event: there is no device here)."""

    class Event:
        calls = 0

        def synchronize(self) -> None:
            Event.calls += 1

    rb = Readback([torch.arange(3)])
    rb._event = Event()
    assert rb.get()[0].tolist() == [0, 1, 2]
    assert rb.get()[0].tolist() == [0, 1, 2]
    assert Event.calls == 1
