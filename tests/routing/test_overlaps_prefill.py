"""The hold-back against its definition: r is held when, for some q not committed that far,
their longest common prefix (of the tokens attach would match) reaches a page, passes what q
has committed, and reaches a page past what the tree holds of r. overlaps_prefill asks it once;
PrefillIndex of a growing set of members (admission, a catch-up batch); take_catchup_batch
splits parked requests with it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokencache_routing.core.holdback import (
    PrefillIndex,
    not_prefilled,
    overlaps_prefill,
    take_catchup_batch,
)

# A request's seq has room after its n tokens (the engine's arrays are made with capacity):
# filled here with tokens of the same alphabet, so that reading past n would be noticed.
_PAD = [2, 0, 1, 1]


def _request(seq: list[int], done: int | None, **fields: Any) -> Any:
    kv = SimpleNamespace(length=done or 0, attached=done is not None)
    padded = np.array(seq + _PAD[: 1 + len(seq) % 4], np.int64)
    return SimpleNamespace(seq=padded, n=len(seq), kv=[kv], **fields)


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


# A member: its tokens after a common prefix, what it committed (None: not attached), and
# whether it is asked about (then added) or only added; each asker's cached length.
_steps = st.lists(
    st.tuples(
        _seqs,
        st.one_of(st.none(), st.integers(0, 24)),
        st.booleans(),
        st.one_of(st.integers(0, 3), st.integers(0, 20)),  # repeats: asked again, a dict
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
# q committed exactly the N = known + page tokens r needs to share: it needs one more.
@example(steps=[([0, 0, 2, 0], 2, False, 0), ([0, 0, 1, 0], None, True, 1)], page=1, prefix=[])
# q committed all that r's attach would match: nothing left to share.
@example(steps=[([0, 0, 0, 0, 0], 2, False, 0), ([0, 0, 0], None, True, 0)], page=1, prefix=[])
# Two members committed past N = known + page, the second one holding r: both are asked.
@example(
    steps=[([1] * 7, 2, False, 0), ([0] * 7, 3, False, 0), ([0] * 6, None, True, 0)],
    page=1,
    prefix=[],
)
@given(steps=_steps, page=st.integers(1, 6), prefix=st.lists(st.integers(0, 2), max_size=12))
def test_the_index_answers_as_the_definition_while_it_grows(
    steps: list[tuple[list[int], int | None, bool, int]], page: int, prefix: list[int]
) -> None:
    """Interleaved asks and adds, the askers' cached lengths differing and repeating (the
    index scans on a length's first ask, keeps a window table from its second, and files
    later members in each): every answer is the brute-force definition's over the members so
    far."""
    index = PrefillIndex(0, page)
    members: list[Any] = []
    for seq, done, ask, known in steps:
        q = _request(prefix + seq, done)
        if ask:
            cached_len = min(known, q.n - 1)
            want = _held(q, members, page, cached_len)
            assert index.holds(q, lambda _x, k=cached_len: k) is want
        index.add(q)
        members.append(q)
    assert len(index) == sum(not_prefilled(q, 0) for q in members)  # the prefilled not kept


def _split(parked: list[Any], cap: int, page: int, known: int) -> tuple[list, list, list]:
    """take_catchup_batch by its definition: each request against the batch so far."""
    batch: list[Any] = []
    rest: list[Any] = []
    held: list[Any] = []
    for r in parked:
        if len(batch) >= cap:
            rest.append(r)
            continue
        chunked = any(q.partial_prefill for q in batch)
        cached_len = min(known, r.n - 1)
        if (
            r.kv[0].attached
            or (r.held_catchup and not chunked)
            or not _held(r, batch, page, cached_len)
        ):
            r.held_catchup = False
            batch.append(r)
        else:
            r.held_catchup = True
            rest.append(r)
            held.append(r)
    return batch, rest, held


@settings(max_examples=300, deadline=None)
@given(
    parked=st.lists(
        st.tuples(_seqs, st.one_of(st.none(), st.integers(0, 24)), st.booleans(), st.booleans()),
        max_size=10,
    ),
    cap=st.integers(1, 10),
    page=st.integers(1, 4),
    known=st.integers(0, 12),
    prefix=st.lists(st.integers(0, 2), max_size=12),
)
def test_a_catchup_batch_is_split_as_defined(
    parked: list[tuple[list[int], int | None, bool, bool]],
    cap: int,
    page: int,
    known: int,
    prefix: list[int],
) -> None:
    """take_catchup_batch against the definition, request by request against the batch so
    far: the batch, the rest and the held in order, and each request's held mark."""

    def requests() -> list[Any]:
        return [
            _request(prefix + seq, done, held_catchup=was_held, partial_prefill=chunked)
            for seq, done, was_held, chunked in parked
        ]

    got, want = requests(), requests()
    split = take_catchup_batch(got, cap, 0, page, lambda r: min(known, r.n - 1))
    expected = _split(want, cap, page, known)
    index_of = {id(r): i for i, r in enumerate(got)} | {id(r): i for i, r in enumerate(want)}
    assert [[index_of[id(r)] for r in part] for part in split] == [
        [index_of[id(r)] for r in part] for part in expected
    ]
    assert [r.held_catchup for r in got] == [r.held_catchup for r in want]
