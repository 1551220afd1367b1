"""The shared-prefix hold-back of a catch-up batch: PrefillIndex against the pairwise scan it
replaced (every first forward against every request taken before it).

B requests make their first forward in the large model, on one 8k system prompt and their own
distinct tokens after it (nobody is held: the common case, where the scan pays for every pair).
The tree holds the prompt ("one": every request asks the same N) or, for each request, a
length of its own ("each": every request asks its own N, as with multi-turn histories cached
to different depths: the index then scans as the pairwise code did). The tree's answer is
looked up here (its match costs the same either way).
Run with `pytest benches/test_holdback.py --benchmark-enable`; with --benchmark-disable every
benchmark runs once as a smoke test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tokencache_routing.core.holdback import committed, take_catchup_batch

PROMPT = 8128
OWN = 300  # room for 256 requests' own cached lengths (below)
PAGE = 1


def _parked(batch: int) -> list[Any]:
    rng = np.random.default_rng(batch)
    prompt = rng.integers(0, 32_000, PROMPT)
    own = rng.permutation(10**6)[: batch * OWN].reshape(batch, OWN)  # no two tokens alike
    return [
        SimpleNamespace(
            seq=np.concatenate((prompt, o)),
            n=PROMPT + OWN,
            kv=[SimpleNamespace(attached=False, length=0)],
            held_catchup=False,
            partial_prefill=False,
        )
        for o in own
    ]


def _cached(parked: list[Any], kind: str) -> Callable[[Any], int]:
    """The tree's answer for each request: the prompt, or the prompt and i of its own tokens
    (request i: its history cached up to there; each asks its own N)."""
    if kind == "one":
        return lambda r: PROMPT
    own = {id(r): PROMPT + i for i, r in enumerate(parked)}
    return lambda r: own[id(r)]


def _pairwise(
    parked: Sequence[Any], kind: int, page: int, cached: Callable[[Any], int]
) -> list[Any]:
    """The scan before PrefillIndex: each request against every one in the batch so far."""
    batch: list[Any] = []
    for r in parked:
        held = False
        known = -1
        for q in batch:
            m = min(r.n, q.n) - 1
            done = committed(q, kind)
            if m < page or done >= m:
                continue
            if known < 0:
                known = cached(r)
            need = max(known + page, done + 1)
            if need > m:
                continue
            lo = need - page
            if r.seq[lo:need].tobytes() == q.seq[lo:need].tobytes() and np.array_equal(
                r.seq[:lo], q.seq[:lo]
            ):
                held = True
                break
        if not held:
            batch.append(r)
    return batch


@pytest.mark.parametrize("cached", ["one", "each"])
@pytest.mark.parametrize("batch", [16, 64, 256])
def test_index(benchmark: Any, batch: int, cached: str) -> None:
    parked = _parked(batch)
    known = _cached(parked, cached)
    taken = benchmark(lambda: take_catchup_batch(parked, batch, 0, PAGE, known)[0])
    assert len(taken) == batch  # nobody shares a page past what the tree holds


@pytest.mark.parametrize("cached", ["one", "each"])
@pytest.mark.parametrize("batch", [16, 64, 256])
def test_pairwise(benchmark: Any, batch: int, cached: str) -> None:
    parked = _parked(batch)
    known = _cached(parked, cached)
    taken = benchmark(lambda: _pairwise(parked, 0, PAGE, known))
    assert len(taken) == batch
