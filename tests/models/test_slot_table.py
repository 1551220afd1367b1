"""The request-to-slot table: rows, growth, queued device writes and the shared-prefix groups it
keeps per row, against a naive model (plain lists, and a search of the slot lists)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencache_models import SlotTable
from tokencache_models.kv.slot_table import _nested_groups
from tokencache_models.shared_prefix.groups import MAX_PREFIX_GROUPS, groups_over_rows

SCRATCH = 999


def test_rows_are_written_appended_released_and_grown() -> None:
    t = SlotTable(rows=2, width=4, scratch_slot=SCRATCH, max_width=64)
    a, b = t.acquire(), t.acquire()
    t.write(a, 0, np.array([1, 2, 3]))
    t.write(b, 0, np.array([7]))
    c = t.acquire()  # a third row: the table doubles its rows, keeping what they hold
    assert t.rows == 4 and t.rows_held == 3
    t.write(c, 0, np.arange(10, 20))  # ten slots: the width doubles past 4 (to 10)
    assert t.width >= 10
    assert t.row(a, 3).tolist() == [1, 2, 3] and t.row(b, 1).tolist() == [7]
    assert t.row(c, 10).tolist() == list(range(10, 20))
    # The scratch row's one entry is the pool's scratch slot, wherever the storage moved.
    assert t.flat_host[t.scratch_start] == SCRATCH and int(t.flat[t.scratch_start]) == SCRATCH
    t.scatter(np.array([a, b]), np.array([3, 1]), np.array([4, 8]))
    assert t.row(a, 4).tolist() == [1, 2, 3, 4] and t.row(b, 2).tolist() == [7, 8]
    assert torch.equal(t.table, torch.from_numpy(t.host))  # one memory on the CPU
    t.release(b)
    with pytest.raises(ValueError, match="not held"):
        t.release(b)
    with pytest.raises(ValueError, match="exceeds"):
        t.write(a, 60, np.arange(10))
    assert t.acquire() == b  # a released row is reused


def test_device_writes_are_queued_and_replayed_in_order() -> None:
    """Off the CPU every write is queued as (flat index, slot); applying the queue to the
    device copy reproduces the host rows exactly (later writes win)."""
    t = SlotTable(rows=4, width=8, scratch_slot=SCRATCH, device="meta", max_width=8)
    device = t.host.copy().reshape(-1)  # what the device held after the last allocation
    r = t.acquire()
    t.write(r, 0, np.array([5, 6, 7]))
    t.scatter(np.array([r, r]), np.array([3, 1]), np.array([8, 9]))  # patches position 1
    t.write(t.acquire(), 2, np.array([4]))
    flat, vals = t.take_writes() or (np.zeros(0, np.int64), np.zeros(0, np.int64))
    device[flat] = vals  # index_copy_ in order: the last write of an index wins
    assert np.array_equal(device, t.flat_host)
    assert t.take_writes() is None  # taken once


rows_strategy = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 4)),  # prompt, cut, q_len
    min_size=2,
    max_size=24,
)


@settings(max_examples=150, deadline=None)
@given(rows_strategy, st.integers(1, 12), st.randoms(use_true_random=False))
def test_groups_claim_only_what_rows_share(
    spec: list[tuple[int, int, int]], min_len: int, rnd: object
) -> None:
    """Rows on four prompts (two of them extending another: nested), each cut short at a random
    point and then on slots of its own. Every group the table reports shares its P slot for slot
    among its members, within every member's cap, rows in at most one group, at most
    MAX_PREFIX_GROUPS groups; one prompt for every row gives one group as long as the search
    of the slot lists finds (the kept facts lose nothing there)."""
    prompts = {0: np.arange(100, 160), 1: np.arange(200, 230)}
    prompts[2] = np.concatenate((prompts[0], np.arange(300, 320)))  # extends prompt 0
    prompts[3] = np.concatenate((prompts[0][:30], np.arange(400, 420)))  # parts from it at 30
    t = SlotTable(rows=4, width=16, scratch_slot=SCRATCH, max_width=4096)
    fresh = iter(range(10_000, 100_000))
    lists, rows, caps = [], [], []
    for prompt, cut, q_len in spec:
        own = np.array([next(fresh) for _ in range(q_len + 3)])
        slots = np.concatenate((prompts[prompt][:cut], own))
        r = t.acquire()
        t.write(r, 0, slots)
        lists.append(slots)
        rows.append(r)
        caps.append(len(slots) - q_len)
    order = list(range(len(rows)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    rows_a, caps_a = np.array(rows)[order], np.array(caps)[order]
    groups = t.prefix_groups(rows_a, caps_a, min_len=min_len)
    seen: set[int] = set()
    assert len(groups) <= MAX_PREFIX_GROUPS
    for g in groups:
        assert len(g.rows) >= 2 and g.length >= min_len and not seen & set(g.rows)
        seen |= set(g.rows)
        anchor = lists[order[g.rows[0]]][: g.length]
        for i in g.rows:
            assert g.length <= caps_a[i]
            assert np.array_equal(lists[order[i]][: g.length], anchor)
    # Asked again (the facts are kept, nothing new to compare), the answer is the same.
    assert t.prefix_groups(rows_a, caps_a, min_len=min_len) == groups
    if len({p for p, _, _ in spec}) == 1 and all(c == 40 for _, c, _ in spec):
        flat = np.concatenate(lists)
        starts = np.cumsum([0] + [len(x) for x in lists])[:-1][order]
        searched = groups_over_rows(flat, starts, caps_a, min_len)
        assert [(g.rows, g.length) for g in groups] == [(g.rows, g.length) for g in searched]


def test_one_prompt_gives_one_group_and_decoding_compares_nothing_new() -> None:
    """32 rows behind one 500-slot prompt: one group of all, P = 500; as they decode (caps grow
    by one a step) the rows that parted from the reference are not compared again."""
    t = SlotTable(rows=32, width=1024, scratch_slot=SCRATCH)
    prompt = np.arange(500)
    rows = np.array([t.acquire() for _ in range(32)])
    for i, r in enumerate(rows.tolist()):
        t.write(r, 0, np.concatenate((prompt, [10_000 + 100 * i, 10_001 + 100 * i])))
    caps = np.full(32, 501)
    (g,) = t.prefix_groups(rows, caps)
    assert g.rows == tuple(range(32)) and g.length == 500
    final = t._final.copy()
    assert final[rows].sum() == 31  # all but the reference's owner parted from it
    for step in range(3):
        for i, r in enumerate(rows.tolist()):
            t.write(r, 502 + step, np.array([20_000 + 100 * i + step]))
        assert t.prefix_groups(rows, caps + 1 + step) == [g]
    # Those were writes (found afresh); appends, as a step's new slots are, keep the answer.
    kept = t.groups_kept
    for step in range(3):
        t.scatter(rows, np.full(32, 505 + step), 30_000 + 100 * np.arange(32) + step)
        assert t.prefix_groups(rows.copy(), caps + 4 + step) == [g]
    assert t.groups_kept == kept + 3
    t.prefix_groups(rows, caps + 7, min_len=0)  # asked as given (0, read as 1): kept for it too
    t.scatter(rows, np.full(32, 508), 40_000 + np.arange(32))
    assert t.prefix_groups(rows, caps + 8, min_len=0) == [g] and t.groups_kept == kept + 4
    # Asked over shorter caps (not a step of steady decoding), the answer is found afresh.
    (short,) = t.prefix_groups(rows, np.full(32, 300))
    assert short.rows == g.rows and short.length == 300
    # A row released and taken again by another prompt (the same row, the same rows array):
    # found afresh too, without the row.
    t.release(int(rows[0]))
    assert t.acquire() == rows[0]
    t.write(int(rows[0]), 0, np.arange(50_000, 50_600))
    (rest,) = t.prefix_groups(rows, np.full(32, 504))
    assert rest.rows == tuple(range(1, 32)) and rest.length == 500


def test_a_patched_entry_is_checked_again_and_cuts_back_its_reference() -> None:
    """Overlap: a step's facts are checked before the previous step's commit, which may patch
    a just-written entry to the cache's slot and free the replaced one. Once that slot is
    reused at the same place by a row on the same reference, no group may claim it."""
    t = SlotTable(rows=4, width=64, scratch_slot=SCRATCH)
    prompt = np.arange(100, 120)
    owner, other = t.acquire(), t.acquire()
    t.write(owner, 0, np.concatenate((prompt, [500])))  # 500: written, not committed yet
    t.write(other, 0, prompt)
    caps = np.array([21, 20])
    assert t.prefix_groups(np.array([owner, other]), caps, min_len=4)  # facts checked to 21
    t.patch(np.array([owner]), np.array([20]), np.array([900]))  # the cache held it: 900
    t.write(other, 20, np.array([500, 501]))  # 500 reused at the same place by the other row
    got = t.prefix_groups(np.array([owner, other]), np.array([21, 22]), min_len=4)
    for g in got:  # a claim past 20 would have the kernel read 900 for the other row's 500
        assert g.length <= 20
    # Unpatched, the stale reference made the same layout claim 21 slots.
    t2 = SlotTable(rows=4, width=64, scratch_slot=SCRATCH)
    a, b = t2.acquire(), t2.acquire()
    t2.write(a, 0, np.concatenate((prompt, [500])))
    t2.write(b, 0, prompt)
    t2.prefix_groups(np.array([a, b]), caps, min_len=4)
    t2.scatter(np.array([a]), np.array([20]), np.array([900]))
    t2.write(b, 20, np.array([500, 501]))
    stale = t2.prefix_groups(np.array([a, b]), np.array([21, 22]), min_len=4)
    assert max(g.length for g in stale) == 21


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([16, 17, 40, 41, 90, 300]), min_size=2, max_size=9), st.data())
def test_nested_groups_save_the_most_a_split_by_levels_can(levels: list[int], data: Any) -> None:
    """_nested_groups (its one-level / one-row-above fast path included) saves exactly what the
    best split of the rows into groups of consecutive shared-length levels saves, found here
    by trying every split; each group's rows all share at least its length."""
    if data.draw(st.booleans()):  # steady decoding's shape: one row above all the others
        levels = [levels[0]] * (len(levels) - 1) + [levels[0] + data.draw(st.integers(0, 50))]
    shared = np.array(levels, np.int64)
    members = np.arange(3, 3 + len(levels), dtype=np.int64)
    groups = _nested_groups(members, shared)
    by_row = dict(zip(members.tolist(), levels, strict=True))
    for g in groups:
        assert len(g.rows) >= 2 and all(by_row[r] >= g.length for r in g.rows)
    distinct = sorted(set(levels), reverse=True)
    best = 0
    for cuts in itertools.product([False, True], repeat=len(distinct) - 1):
        # a cut after level i ends a group there; each group runs at its lowest level
        saved, rows_in = 0, 0
        for i, lv in enumerate(distinct):
            rows_in += levels.count(lv)
            if i == len(distinct) - 1 or cuts[i]:
                saved += max(rows_in - 1, 0) * lv
                rows_in = 0
        best = max(best, saved)
    assert sum(g.saved_reads for g in groups) == best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 3)), min_size=2, max_size=12
    ),
    st.lists(
        st.sampled_from(["decode"] * 3 + ["dedup"] * 2 + ["patch", "admit", "release"]),
        max_size=16,
    ),
    st.integers(1, 12),
    st.randoms(use_true_random=False),
)
def test_kept_groups_are_the_groups_asked_afresh(
    spec: list[tuple[int, int, int]], ops: list[str], min_len: int, rnd: Any
) -> None:
    """Steady decoding asks prefix_groups over the same rows array each step and gets the kept
    answer (_Carried) while only appends happened. After every step the answer equals the one
    the kept facts give when asked afresh (the kept answer dropped), and every claim holds slot
    for slot in the rows as written. In between: patches (a commit's cached slot: one no row
    holds, or, as a tree's dedup gives, the slot another row on the same path holds there, so
    the two share more than before), admissions and releases."""
    prompts = {0: np.arange(100, 160), 1: np.arange(200, 230)}
    prompts[2] = np.concatenate((prompts[0], np.arange(300, 320)))
    prompts[3] = np.concatenate((prompts[0][:30], np.arange(400, 420)))
    t = SlotTable(rows=4, width=16, scratch_slot=SCRATCH, max_width=4096)
    fresh = iter(range(10_000, 1_000_000))
    lists: dict[int, list[int]] = {}

    def admit(prompt: int, cut: int, own: int) -> None:
        # As a forward's rows hold: the slots from its cap on are the step's new ones, fresh.
        slots = np.concatenate((prompts[prompt][:cut], [next(fresh) for _ in range(own)]))
        r = t.acquire()
        t.write(r, 0, slots)
        lists[r] = slots.tolist()

    for prompt, cut, own in spec:
        admit(prompt, cut, own)
    rows = np.array(sorted(lists))
    for op in ["decode", *ops]:
        if op == "decode":  # one fresh slot a row, appended; the same rows array asked again
            new = np.array([next(fresh) for _ in rows])
            t.scatter(rows, np.array([len(lists[r]) for r in rows.tolist()]), new)
            for r, s in zip(rows.tolist(), new.tolist(), strict=True):
                lists[r].append(s)
        elif op in ("patch", "dedup"):
            # A commit finds one of a row's newest slots cached (with overlap, the step
            # before the newest): the tree's slot for that token on the row's path replaces
            # it: one no row holds (a finished request's), or, a dedup, the one another row
            # on the same path holds there (so the two share one more slot).
            r = int(rnd.choice(rows.tolist()))
            pos = len(lists[r]) - rnd.randint(1, 2)
            same_path = [
                o for o in rows.tolist()
                if o != r and len(lists[o]) > pos and lists[o][:pos] == lists[r][:pos]
            ]  # fmt: skip
            if op == "patch" or not same_path:
                cached = next(fresh)
            else:
                cached = lists[int(rnd.choice(same_path))][pos]
            t.patch(np.array([r]), np.array([pos]), np.array([cached]))
            lists[r][pos] = cached
        elif op == "admit":
            admit(*spec[rnd.randrange(len(spec))])
            rows = np.array(sorted(lists))
        elif len(rows) > 2:  # release
            r = int(rnd.choice(rows.tolist()))
            t.release(r)
            del lists[r]
            rows = np.array(sorted(lists))
        if op == "decode" and rnd.random() < 0.5:
            rows = rows.copy()  # the serial path: an equal array, not the same one
        caps = np.array([len(lists[r]) - 1 for r in rows.tolist()])  # the last: this step's
        got = t.prefix_groups(rows, caps, min_len=min_len)
        t._carried = None
        assert got == t.prefix_groups(rows, caps, min_len=min_len)
        for g in got:
            anchor = lists[int(rows[g.rows[0]])][: g.length]
            for i in g.rows:
                assert g.length <= caps[i]
                assert lists[int(rows[i])][: g.length] == anchor


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(16, 60), min_size=2, max_size=40))
def test_merged_levels_keep_every_row_they_counted(levels: list[int]) -> None:
    """Past MAX_LEVELS distinct shared lengths the shortest levels are merged into one (at
    its least length): a group reaching that level takes every row merged into it, so each
    group has the rows its saving was counted with (never a row alone), and the groups save
    at least what one group of every row at the least length would (a split the search
    weighs)."""
    shared = np.array(levels, np.int64)
    groups = _nested_groups(np.arange(len(levels), dtype=np.int64), shared)
    seen: set[int] = set()
    for g in groups:
        assert len(g.rows) >= 2 and not seen & set(g.rows)
        seen |= set(g.rows)
        assert all(levels[r] >= g.length for r in g.rows)
    assert sum(g.saved_reads for g in groups) >= (len(levels) - 1) * min(levels)


def test_a_tie_at_the_top_is_found_afresh() -> None:
    """29 rows on one prompt at many shared lengths (past MAX_LEVELS, merged), the longest
    two tied: after a step only the owner of the two rises, a level more, and the merge and
    the split change. The kept answer is not given there (_top_alone): the one found afresh
    is."""
    levels = [37, 18, 42, 27, 47, 52, 51, 46, 52, 35, 21, 32, 34, 35, 32, 25, 16, 30, 23, 44]
    levels += [27, 45, 36, 22, 17, 23, 16, 17, 28]
    order = [5] + [i for i in range(len(levels)) if i != 5]  # the owner: a longest row, first
    t = SlotTable(rows=32, width=64, scratch_slot=SCRATCH)
    prompt = np.arange(100, 160)
    fresh = iter(range(10_000, 100_000))
    rows = []
    for i in order:
        r = t.acquire()
        t.write(r, 0, np.concatenate((prompt[: levels[i]], [next(fresh)])))
        rows.append(r)
    rows_a, caps = np.array(rows), np.array([levels[i] for i in order])
    before = t.prefix_groups(rows_a, caps, min_len=16)
    t.scatter(rows_a, caps + 1, np.array([next(fresh) for _ in rows]))  # a decode step
    after = t.prefix_groups(rows_a, caps + 1, min_len=16)
    t._carried = None
    assert after == t.prefix_groups(rows_a, caps + 1, min_len=16) != before
