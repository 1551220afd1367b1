"""Misuse the tree promises to refuse: each call raises its specific
TokenCacheError subclass and leaves the tree and every cursor exactly as they were."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import tokencache as tc


def snapshot(tree: tc.RadixTree, *cursors: tc.Cursor) -> tuple[Any, ...]:
    """Everything a refused call must leave unchanged."""
    return (
        tree.pretty_print(),
        sorted(tree.all_slots().tolist()),
        (tree.total_size(), tree.evictable_size(), tree.protected_size(), tree.node_count()),
        [(c.length, c.cached_length, c.slots().tolist(), c.released) for c in cursors],
    )


def refuse(error: type[Exception], tree: tc.RadixTree, call: Any, *cursors: tc.Cursor) -> str:
    """Run a call that must be refused; return the message after checking nothing changed."""
    before = snapshot(tree, *cursors)
    with pytest.raises(error) as info:
        call()
    assert snapshot(tree, *cursors) == before
    tree.check_invariants()
    return str(info.value)


def populated(**kwargs: Any) -> tuple[tc.RadixTree, tc.Cursor, tc.Cursor]:
    """A tree with a cached prompt, a locked node and two cursors, one with an uncached tail."""
    tree = tc.RadixTree(**kwargs)
    tree.insert([7, 8, 9, 10], [0, 1, 2, 3])
    tree.lock(tree.match_prefix([7, 8]).node)
    a = tree.cursor()
    a.extend([7, 8, 9, 10, 11], [40, 41, 42, 43, 44])
    b = tree.cursor()
    b.extend([1, 2], [50, 51])
    return tree, a, b


# Item 6: one cursor twice in a batch (PyO3 used to raise "RuntimeError: Already borrowed").


@pytest.mark.parametrize("order", [[0, 0], [0, 1, 0], [1, 0, 1]])
def test_extend_many_refuses_the_same_cursor_twice(order: list[int]) -> None:
    tree, a, b = populated()
    batch = [(a, b)[i] for i in order]
    offsets = np.arange(len(batch) + 1)
    tokens, slots = np.arange(len(batch)) + 100, np.arange(len(batch)) + 100
    msg = refuse(
        tc.DuplicateCursorError, tree, lambda: tree.extend_many(batch, offsets, tokens, slots), a, b
    )
    assert "same cursor" in msg
    assert issubclass(tc.DuplicateCursorError, tc.TokenCacheError)
    assert issubclass(tc.DuplicateCursorError, ValueError)
    tree.extend_many([a, b], [0, 1, 2], [100, 101], [100, 101])  # both usable afterwards
    assert (a.length, b.length) == (6, 3)


def test_a_cursor_held_by_another_thread_is_busy_not_already_borrowed() -> None:
    """extend_many holds its cursors without the GIL; a call on one of them meanwhile raises
    CursorBusyError at once (never blocks) and the batches still complete correctly."""
    tree = tc.RadixTree()
    cursor = tree.cursor()
    n = 100_000
    stop = threading.Event()
    completed: list[int] = []
    failures: list[BaseException] = []

    def extend() -> None:
        try:
            # Until the main thread has seen the cursor busy (within a few batches here; up to
            # 200 of them on a loaded machine, ~20M tokens at worst).
            for i in range(200):
                if stop.is_set():
                    break
                base = i * n
                tree.extend_many([cursor], [0, n], np.arange(n) % 7, np.arange(base, base + n))
                completed.append(i)
        except BaseException as e:  # surfaced below
            failures.append(e)

    worker = threading.Thread(target=extend)
    worker.start()
    busy = 0
    while worker.is_alive():
        try:
            _ = cursor.length
        except tc.CursorBusyError:
            busy += 1
            stop.set()
    worker.join()
    assert not failures, failures
    assert busy > 0, "no batch overlapped a call on its cursor"
    assert cursor.length == n * len(completed)
    assert issubclass(tc.CursorBusyError, RuntimeError)
    tree.check_invariants()


# Item 7: one slot twice within a call.


def test_insert_refuses_a_slot_given_twice() -> None:
    tree, a, b = populated()
    msg = refuse(tc.DuplicateSlotError, tree, lambda: tree.insert([1, 2], [5, 5]), a, b)
    assert "slot 5" in msg and "[0, 1]" in msg
    # Inside the already-cached prefix too: the caller would free that slot twice.
    refuse(tc.DuplicateSlotError, tree, lambda: tree.insert([7, 8, 9], [60, 60, 61]), a, b)


def test_cursor_extend_refuses_a_slot_given_twice() -> None:
    tree, a, b = populated()
    msg = refuse(tc.DuplicateSlotError, tree, lambda: b.extend([1, 2], [300, 300]), a, b)
    assert "slot 300" in msg


def test_cursor_extend_refuses_a_slot_of_its_own_uncached_tail() -> None:
    tree, a, b = populated(page_size=2)
    assert a.cached_length == 4 and a.length == 5  # slot 44 is a's uncached tail
    msg = refuse(tc.DuplicateSlotError, tree, lambda: a.extend([12], [44]), a, b)
    assert "uncached tail" in msg


def test_extend_many_refuses_a_slot_shared_by_two_requests() -> None:
    tree, a, b = populated()
    msg = refuse(
        tc.DuplicateSlotError,
        tree,
        lambda: tree.extend_many([a, b], [0, 2, 3], [12, 13, 3], [70, 71, 71]),
        a,
        b,
    )
    assert "request 0 at [1]" in msg and "request 1 at [0]" in msg


def test_a_slot_the_tree_holds_is_refused_only_with_strict_slots() -> None:
    # Default: only repeats within one call are checked (O(slots given)); a caller that hands
    # the tree a slot it already holds breaks it, and check_invariants says so.
    loose = tc.RadixTree()
    loose.insert([1], [5])
    loose.insert([2], [5])
    with pytest.raises(AssertionError, match="slot 5 is held twice"):
        loose.check_invariants()
    # strict_slots=True: refused, whether new token, cursor, or a matched token given
    # another held slot; the very slots the tree holds for these tokens stay accepted.
    tree, a, b = populated(strict_slots=True)
    refuse(tc.DuplicateSlotError, tree, lambda: tree.insert([3], [1]), a, b)
    refuse(tc.DuplicateSlotError, tree, lambda: tree.insert([3], [44], "salt"), a, b)
    refuse(tc.DuplicateSlotError, tree, lambda: tree.insert([7, 8], [0, 2]), a, b)
    refuse(tc.DuplicateSlotError, tree, lambda: b.extend([3], [51]), a, b)
    assert tree.insert([7, 8, 9, 10], [0, 1, 2, 3]).prefix_len == 4
    assert b.extend([3], [52]) is None
    tree.check_invariants()


# Item 8: inserted_len past the tokens given.


@pytest.mark.parametrize("inserted_len", [5, 3, -1])
def test_insert_refuses_inserted_len_outside_the_tokens(inserted_len: int) -> None:
    tree, a, b = populated()
    msg = refuse(
        tc.InvalidArgumentError,
        tree,
        lambda: tree.insert([1, 2], [60, 61], inserted_len=inserted_len),
        a,
        b,
    )
    assert "inserted_len" in msg
    assert tree.insert([1, 2], [60, 61], inserted_len=2).prefix_len == 2


# Item 9: page alignment is checked only with strict_pages=True (the default is False).


def test_page_alignment_is_checked_only_with_strict_pages() -> None:
    loose = tc.RadixTree(page_size=4)
    loose.insert([1, 2, 3, 4], [4, 5, 7, 8])  # not one aligned run: accepted by default
    assert loose.total_size() == 4
    loose.check_invariants()
    tree, a, b = populated(page_size=4, strict_pages=True)
    refuse(tc.PageAlignmentError, tree, lambda: tree.insert([1, 2, 3, 4], [4, 5, 7, 8]), a, b)
    refuse(tc.PageAlignmentError, tree, lambda: b.extend([3, 4, 5, 6], [9, 10, 11, 12]), a, b)
    tree.insert([1, 2, 3, 4], [100, 101, 102, 103])
    tree.check_invariants()


def test_docs_state_the_strict_defaults() -> None:
    doc = tc.RadixTree.__doc__ or ""
    assert "strict_pages" in doc and "strict_slots" in doc and "False" in doc
