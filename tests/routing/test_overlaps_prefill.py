"""overlaps_prefill against the definition: r is held when, for some q not committed that far,
their longest common prefix (of the tokens attach would match) reaches a page, passes what q
has committed, and reaches a page past what the tree holds of r."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokencache_routing.core.batch import not_prefilled, overlaps_prefill


def _request(seq: list[int], done: int | None) -> Any:
    kv = SimpleNamespace(length=done or 0, attached=done is not None)
    return SimpleNamespace(seq=np.array(seq, np.int64), n=len(seq), kv=[kv])


def _held(r: Any, running: list[Any], page: int, known: int) -> bool:
    """The definition, by brute force over every q."""
    for q in running:
        m = min(r.n, q.n) - 1
        common = 0
        while common < m and r.seq[common] == q.seq[common]:
            common += 1
        done = q.kv[0].length if q.kv[0].attached else 0
        if common >= page and common > done and common >= known + page:
            return True
    return False


# Few distinct tokens, so requests share long prefixes; lengths around a few pages.
_seqs = st.lists(st.integers(0, 2), min_size=1, max_size=24)


@settings(max_examples=400, deadline=None)
# q committed exactly as far as the two agree: nothing of the common prefix is left to
# prefill, so r is not held (past it by one token, it is).
@example(r=[0, 0, 0, 1, 2], qs=[([0, 0, 0, 2, 2], 3)], page=1, known=0, prefix=[])
@example(r=[0, 0, 0, 1, 2], qs=[([0, 0, 0, 2, 2], 2)], page=1, known=0, prefix=[])
@given(
    r=_seqs,
    qs=st.lists(st.tuples(_seqs, st.one_of(st.none(), st.integers(0, 24))), max_size=5),
    page=st.integers(1, 6),
    known=st.integers(0, 20),
    prefix=st.lists(st.integers(0, 2), max_size=12),
)
def test_overlaps_prefill_is_the_definition(
    r: list[int], qs: list[tuple[list[int], int | None]], page: int, known: int, prefix: list[int]
) -> None:
    req = _request(prefix + r, None)
    running = [_request(prefix + q, done) for q, done in qs]
    calls: list[int] = []

    def cached(x: Any) -> int:
        calls.append(1)
        return min(known, x.n - 1)

    want = _held(req, running, page, min(known, req.n - 1))
    assert overlaps_prefill(req, running, 0, page, cached) is want
    # Without a tree to ask, nothing counts as cached.
    assert overlaps_prefill(req, running, 0, page) is _held(req, running, page, 0)
    assert len(calls) <= 1  # the tree is asked once at most
    # The requests it can ever find are the ones still prefilling (admission's pre-filter).
    assert overlaps_prefill(req, [q for q in running if not_prefilled(q, 0)], 0, page, cached) is (
        want
    )


def test_not_prefilled_is_kv_short_of_the_last_token() -> None:
    """A request is still prefilling in a model until its KV there is committed up to its
    last token (attach matches all but that one); one never attached there is prefilling."""
    seq = [1, 2, 3, 4, 5]
    assert not not_prefilled(_request(seq, 4), 0)  # committed up to its last token
    assert not_prefilled(_request(seq, 3), 0)  # a chunk of its prompt still to run
    assert not_prefilled(_request(seq, None), 0)  # not attached: all of it
