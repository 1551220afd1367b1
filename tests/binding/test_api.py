"""Behaviour of the binding: results, array types, and errors that leave the tree unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import tokencache as tc


def snapshot(tree: tc.RadixTree) -> tuple[str, list[int]]:
    return tree.pretty_print(), sorted(tree.all_slots().tolist())


def test_match_returns_one_int64_array_and_splits() -> None:
    tree = tc.RadixTree()
    tree.insert(np.array([1, 2, 3, 4]), np.array([10, 11, 12, 13]))
    m = tree.match_prefix(np.array([1, 2, 7]))
    assert m.length == 2
    assert isinstance(m.slots, np.ndarray) and m.slots.dtype == np.int64
    assert m.slots.tolist() == [10, 11]
    assert tree.node_count() == 2
    assert tree.path_length(m.node) == 2
    tree.check_invariants()


def test_a_nodes_key_is_the_edge_into_it() -> None:
    """SGLang's TreeNode.key: the tokens from the parent to the node, empty at a root."""
    tree = tc.RadixTree(page_size=2)
    assert tree.root.key.dtype == np.int64 and len(tree.root.key) == 0
    first = tree.insert([1, 2, 3, 4], [10, 11, 12, 13]).node
    assert first.key.tolist() == [1, 2, 3, 4]
    m = tree.match_prefix([1, 2, 9, 9])  # ends inside the node: it splits there
    assert m.node.key.tolist() == [1, 2] and first.key.tolist() == [3, 4]
    cur = tree.cursor(namespace="other")
    assert cur.node.is_root and len(cur.node.key) == 0
    cur.extend([5, 6, 7], [20, 21, 22])  # the last token waits for its page
    assert cur.node.key.tolist() == [5, 6]
    cur.release()
    tree.reset()
    with pytest.raises(tc.StaleHandleError):
        first.key  # noqa: B018


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint64])
def test_token_dtypes(dtype: type) -> None:
    tree = tc.RadixTree()
    tree.insert(np.array([5, 6], dtype=dtype), np.array([0, 1], dtype=np.int64))
    assert tree.match_prefix([5, 6]).length == 2


def test_sizes_track_locks() -> None:
    tree = tc.RadixTree()
    node = tree.insert([1, 2, 3], [0, 1, 2]).node
    assert (tree.evictable_size(), tree.protected_size(), tree.total_size()) == (3, 0, 3)
    assert tree.lock(node) == 3
    assert (tree.evictable_size(), tree.protected_size()) == (0, 3)
    assert tree.evict(5).size == 0
    assert tree.unlock(node) == 3
    assert sorted(tree.evict(1).tolist()) == [0, 1, 2]
    assert not node.is_alive()


def test_cursor_hand_off_round_trip() -> None:
    tree = tc.RadixTree()
    a = tree.cursor()
    assert a.extend(np.arange(8), np.arange(100, 108)) is None
    b = tree.cursor()
    d = b.extend(np.array([0, 1, 2, 9]), np.array([200, 201, 202, 203]))
    assert d is not None and len(d) == 3
    assert d.freed.tolist() == [200, 201, 202]
    assert d.slots.tolist() == [100, 101, 102]
    assert d.positions.tolist() == [0, 1, 2]
    assert b.slots().tolist() == [100, 101, 102, 203]
    assert b.tokens().tolist() == [0, 1, 2, 9]
    assert a.truncate(2).tolist() == [106, 107]
    assert a.release().size == 0
    assert b.release().size == 0
    assert tree.protected_size() == 0
    tree.check_invariants()


def test_extend_many_is_one_call_for_a_batch() -> None:
    tree = tc.RadixTree()
    cursors = [tree.cursor() for _ in range(3)]
    offsets = np.array([0, 2, 2, 5])
    d = tree.extend_many(cursors, offsets, np.array([1, 2, 1, 2, 3]), np.arange(5))
    assert d.request.tolist() == [2, 2] and d.freed.tolist() == [2, 3]
    assert [c.length for c in cursors] == [2, 0, 3]
    tree.check_invariants()


def test_events_can_be_drained() -> None:
    tree = tc.RadixTree(page_size=2, enable_events=True)
    tree.insert([1, 2, 3, 4], [0, 1, 2, 3])
    events = tree.take_events()
    assert [e.kind for e in events] == ["stored"]
    assert len(events[0].page_hashes) == 2 and events[0].token_ids == [1, 2, 3, 4]
    assert tree.take_events() == []


BAD_CALLS = [
    (tc.InvalidTokenError, lambda t: t.insert([1, -1], [0, 1])),
    (tc.InvalidTokenError, lambda t: t.insert(np.array([2**32]), [0])),
    (tc.ShapeError, lambda t: t.insert([1, 2], [0])),
    (tc.ShapeError, lambda t: t.insert(np.zeros((2, 2), dtype=np.int64), [0, 1])),
    (tc.ShapeError, lambda t: t.insert(np.array([1.0, 2.0]), [0, 1])),
    (tc.ShapeError, lambda t: t.match_prefix("abc")),
    (tc.InvalidTokenError, lambda t: t.cached_prefix_len([1, -1])),
    (tc.ShapeError, lambda t: t.cached_prefix_len(np.zeros((2, 2), dtype=np.int64))),
    (tc.InvalidArgumentError, lambda t: t.insert([1], [-5])),
    (tc.InvalidArgumentError, lambda t: t.evict(-1)),
    (tc.ForeignHandleError, lambda t: t.lock(tc.RadixTree().root)),
    (tc.LockStateError, lambda t: t.unlock(t.root)),
    (
        tc.ShapeError,
        lambda t: t.extend_many([t.cursor()], np.array([0, 3]), np.array([1]), np.array([0])),
    ),
]


@pytest.mark.parametrize(("error", "call"), BAD_CALLS)
def test_bad_input_raises_and_changes_nothing(error: type[Exception], call) -> None:  # type: ignore[no-untyped-def]
    tree = tc.RadixTree()
    tree.insert([7, 8, 9], [0, 1, 2])
    tree.match_prefix([7, 8, 9])
    before = snapshot(tree)
    with pytest.raises(error):
        call(tree)
    assert snapshot(tree) == before
    tree.check_invariants()


def test_error_hierarchy() -> None:
    assert issubclass(tc.InvalidTokenError, tc.TokenCacheError)
    assert issubclass(tc.InvalidTokenError, ValueError)
    assert issubclass(tc.StaleHandleError, KeyError)
    assert issubclass(tc.LockStateError, RuntimeError)


def test_stale_handles_and_cursors() -> None:
    tree = tc.RadixTree()
    node = tree.insert([1, 2], [0, 1]).node
    cur = tree.cursor()
    cur.extend([3], [2])
    assert sorted(tree.reset().tolist()) == [0, 1, 2]
    with pytest.raises(tc.StaleHandleError):
        tree.lock(node)
    with pytest.raises(tc.StaleHandleError):
        cur.extend([4], [3])
    assert cur.release().size == 0
    with pytest.raises(tc.LockStateError):
        cur.release()
    with pytest.raises(tc.InvalidArgumentError):
        tc.RadixTree(eviction_policy="random")
    with pytest.raises(tc.InvalidArgumentError):
        tc.RadixTree(page_size=0)


def test_strict_pages_rejects_misaligned_slots() -> None:
    tree = tc.RadixTree(page_size=4, strict_pages=True)
    with pytest.raises(tc.PageAlignmentError):
        tree.insert([1, 2, 3, 4], [4, 5, 7, 8])
    tree.insert([1, 2, 3, 4], [4, 5, 6, 7])
    assert tree.total_size() == 4


def test_truncate_into_a_shared_partial_page_is_refused() -> None:
    tree = tc.RadixTree(page_size=2)
    a = tree.cursor()
    a.extend([1, 2, 3, 4], [0, 1, 2, 3])
    b = tree.cursor()
    b.extend([1, 2, 3, 4], [4, 5, 6, 7])
    before = snapshot(tree)
    with pytest.raises(tc.PageAlignmentError):
        a.truncate(1)
    assert snapshot(tree) == before and a.length == 4
