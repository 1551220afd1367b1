"""SGLang's own RadixCache unit tests (test/srt/test_radix_cache_unit.py, the cases of its
prefix-cache contract that 0.5.23's API runs: not those of TreeNode / RadixKey internals, nor of
features newer than 0.5.23 such as partial-prefix reuse), each run on RadixCache and on this
backend with the same assertions, plus the two behaviours they found missing here:
``kv_events`` set as RadixCache sets it, and an insert whose value repeats a slot (SGLang's
token-id fallback)."""

from __future__ import annotations

import unittest.mock
from array import array
from types import SimpleNamespace
from typing import Any

import pytest


@pytest.fixture(params=["RadixCache", "TokenCacheRadixCache"])
def cls(request: pytest.FixtureRequest, sgl: SimpleNamespace) -> Any:
    return sgl.RadixCache if request.param == "RadixCache" else sgl.cache.TokenCacheRadixCache


def key(sgl: SimpleNamespace, tokens: list[int], **kw: Any) -> Any:
    return sgl.RadixKey(array("q", tokens), **kw)


def insert(sgl: SimpleNamespace, cache: Any, tokens: list[int], value: list[int] | None) -> Any:
    v = None if value is None else sgl.torch.tensor(value, dtype=sgl.torch.int64)
    return cache.insert(sgl.InsertParams(key=key(sgl, tokens), value=v))


def match(sgl: SimpleNamespace, cache: Any, tokens: list[int]) -> Any:
    return cache.match_prefix(sgl.MatchPrefixParams(key=key(sgl, tokens)))


def events_of(cache: Any) -> list[Any]:
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared

    return [e for e in cache.take_events() if not isinstance(e, AllBlocksCleared)]


@pytest.mark.parametrize(
    ("page_size", "disable", "enable_events"),
    [(1, False, False), (4, False, True), (1, True, True)],
)
def test_init_variations(
    sgl: SimpleNamespace, cls: Any, page_size: int, disable: bool, enable_events: bool
) -> None:
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    cache = cls.create_simulated(
        disable=disable, page_size=page_size, enable_kv_cache_events=enable_events
    )
    assert cache.page_size == page_size and cache.disable == disable
    assert cache.device == sgl.torch.device("cpu")
    # RadixCache always sets a recorder; a disabled tree's records nothing.
    assert isinstance(cache.kv_events, KVCacheEventRecorder)
    assert cache.kv_events.enabled == (enable_events and not disable)
    assert cache.root_node is not None
    assert len(cache.root_node.key) == 0


def test_a_nodes_key_is_the_edge_into_it(sgl: SimpleNamespace, cls: Any) -> None:
    """TreeNode.key: the tokens from the node's parent to it; a split shortens the deeper
    node's key (the node itself is kept)."""
    cache = cls.create_simulated(page_size=2)

    def tokens(node: Any) -> list[int]:
        return [int(t) for t in node.key]

    insert(sgl, cache, [1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    whole = match(sgl, cache, [1, 2, 3, 4, 5, 6]).last_device_node
    assert tokens(whole) == [1, 2, 3, 4, 5, 6]
    head = match(sgl, cache, [1, 2, 3, 4, 9, 9]).last_device_node
    assert tokens(head) == [1, 2, 3, 4]
    assert tokens(match(sgl, cache, [1, 2, 3, 4, 5, 6]).last_device_node) == [5, 6]
    assert tokens(cache.root_node) == []


def test_reset(sgl: SimpleNamespace, cls: Any) -> None:
    cache = cls.create_simulated()
    insert(sgl, cache, [1, 2, 3], [10, 20, 30])
    assert cache.total_size() > 0
    cache.reset()
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)


@pytest.mark.parametrize("disable", [False, True])
def test_insert_and_match_basic(sgl: SimpleNamespace, cls: Any, disable: bool) -> None:
    cache = cls.create_simulated(disable=disable)
    assert insert(sgl, cache, [1, 2, 3], [10, 20, 30]).prefix_len == 0
    if disable:
        assert cache.total_size() == 0
        return
    assert cache.total_size() == 3 and cache.evictable_size() == 3
    for tokens, want in (([1, 2, 3], [10, 20, 30]), ([1, 2], [10, 20])):
        r = match(sgl, cache, tokens)
        assert r.device_prefix_len == len(want)
        assert cache.path_device_indices(r.last_device_node)[: len(want)].tolist() == want


def test_insert_with_none_value(sgl: SimpleNamespace, cls: Any) -> None:
    cache = cls.create_simulated()
    assert insert(sgl, cache, [1, 2, 3], None).prefix_len == 0
    assert cache.total_size() == 3


def test_total_size(sgl: SimpleNamespace, cls: Any) -> None:
    cache = cls.create_simulated()
    assert cache.total_size() == 0
    insert(sgl, cache, [1, 2, 3], [10, 20, 30])
    assert cache.total_size() == 3
    insert(sgl, cache, [4, 5], [40, 50])
    assert cache.total_size() == 5


@pytest.mark.parametrize(("page_size", "enable_events"), [(1, True), (2, True), (1, False)])
def test_kv_cache_events(
    sgl: SimpleNamespace, cls: Any, page_size: int, enable_events: bool
) -> None:
    from sglang.srt.disaggregation.kv_events import BlockStored

    cache = cls.create_simulated(page_size=page_size, enable_kv_cache_events=enable_events)
    insert(sgl, cache, [1, 2, 3, 4, 5], None)
    events = cache.take_events()
    if not enable_events:
        assert events == []
        return
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored
    for e in stored:
        assert e.block_size <= page_size
        assert len(e.token_ids) == e.block_size * len(e.block_hashes)


def test_kv_cache_events_with_eviction(sgl: SimpleNamespace, cls: Any) -> None:
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

    allocator = unittest.mock.Mock()
    allocator.device = sgl.torch.device("cpu")
    cache = cls.create_simulated(mock_allocator=allocator, page_size=2, enable_kv_cache_events=True)
    insert(sgl, cache, [1, 2, 3, 4], [10, 20, 30, 40])
    assert cache.evict(sgl.EvictParams(num_tokens=4)).num_tokens_evicted >= 4
    events = cache.take_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(stored) == 2
    assert len(removed) == 1 and removed[0].block_hashes == stored


def test_extra_key_isolation(sgl: SimpleNamespace, cls: Any) -> None:
    cache = cls.create_simulated()
    for extra, first in (("key1", 10), ("key2", 40), (None, 70)):
        v = sgl.torch.tensor([first, first + 10, first + 20], dtype=sgl.torch.int64)
        cache.insert(sgl.InsertParams(key=key(sgl, [1, 2, 3], extra_key=extra), value=v))
    for extra, first in (("key1", 10), ("key2", 40), (None, 70), ("nonexistent", None)):
        r = cache.match_prefix(sgl.MatchPrefixParams(key=key(sgl, [1, 2, 3], extra_key=extra)))
        if first is None:
            assert r.device_prefix_len == 0
        else:
            got = cache.path_device_indices(r.last_device_node).tolist()
            assert got == [first, first + 10, first + 20]


def test_lock_ref_operations(sgl: SimpleNamespace, cls: Any) -> None:
    cache = cls.create_simulated()
    insert(sgl, cache, [1, 2, 3], [10, 20, 30])
    node = match(sgl, cache, [1, 2, 3]).last_device_node
    evictable, protected = cache.evictable_size(), cache.protected_size()
    cache.inc_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (evictable - 3, protected + 3)
    cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)


def test_evict_functionality(sgl: SimpleNamespace, cls: Any) -> None:
    allocator = unittest.mock.Mock()
    allocator.device = sgl.torch.device("cpu")
    cache = cls.create_simulated(mock_allocator=allocator)
    insert(sgl, cache, [1, 2], [10, 20])
    insert(sgl, cache, [3, 4], [30, 40])
    before = cache.total_size()
    assert cache.evict(sgl.EvictParams(num_tokens=2)).num_tokens_evicted >= 2
    allocator.free_segment.assert_called()
    assert cache.total_size() < before


@pytest.mark.parametrize(("page_size", "length"), [(1, 5), (2, 5), (4, 6)])
def test_page_alignment_boundary(
    sgl: SimpleNamespace, cls: Any, page_size: int, length: int
) -> None:
    cache = cls.create_simulated(page_size=page_size)
    tokens = list(range(length))
    insert(sgl, cache, tokens, tokens)
    r = match(sgl, cache, tokens)
    assert r.device_prefix_len > 0 and r.device_prefix_len % page_size == 0


@pytest.mark.parametrize("page_size", [1, 2])
def test_advanced_prefix_match_with_node_splits(
    sgl: SimpleNamespace, cls: Any, page_size: int
) -> None:
    cache = cls.create_simulated(page_size=page_size)
    seq1, seq2 = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 10]
    insert(sgl, cache, seq1, [x * 10 for x in seq1])
    insert(sgl, cache, seq2, [x * 10 for x in seq2])
    assert cache.total_size() == 10

    def slots(tokens: list[int]) -> list[int]:
        r = match(sgl, cache, tokens)
        got: list[int] = cache.path_device_indices(r.last_device_node).tolist()
        return got[: r.device_prefix_len]

    assert slots([1, 2, 3, 4, 999, 1000]) == [10, 20, 30, 40]
    assert cache.total_size() == 10  # a split changes no data
    assert slots(seq1) == [x * 10 for x in seq1]
    assert slots([1, 2, 3, 4, 5, 6, 777, 888]) == [10, 20, 30, 40, 50, 60]
    assert slots(seq2) == [x * 10 for x in seq2]


def test_hash_value_repeating_tokens(sgl: SimpleNamespace, cls: Any) -> None:
    """Token-id values repeat here ([1, 2, 3, 4] twice): one of the two cases that failed."""
    from sglang.srt.disaggregation.kv_events import BlockStored

    cache = cls.create_simulated(page_size=4, enable_kv_cache_events=True)
    insert(sgl, cache, [1, 2, 3, 4, 1, 2, 3, 4], None)
    (stored,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    first, second = stored.block_hashes
    assert first != second  # position-aware hashes
    assert stored.parent_block_hash is None


# ------------------------------------------------------------ what these tests found missing


@pytest.mark.parametrize("page_size", [1, 2])
def test_repeated_slots_in_one_insert_behave_as_radix_cache(
    sgl: SimpleNamespace, page_size: int
) -> None:
    """SGLang's fallback inserts token ids as values, so [1, 2, 1, 2] repeats slots 1 and 2:
    RadixCache stores them as given; so does the backend (in runs the native tree accepts)."""
    runs: dict[str, Any] = {}
    for name in ("RadixCache", "TokenCacheRadixCache"):
        c = sgl.RadixCache if name == "RadixCache" else sgl.cache.TokenCacheRadixCache
        allocator = unittest.mock.Mock()
        allocator.device = sgl.torch.device("cpu")
        cache = c.create_simulated(
            mock_allocator=allocator, page_size=page_size, enable_kv_cache_events=True
        )
        first = insert(sgl, cache, [1, 2, 1, 2, 3, 1, 2, 1], None).prefix_len
        second = insert(sgl, cache, [1, 2, 1, 2, 5, 6], None).prefix_len
        m = match(sgl, cache, [1, 2, 1, 2, 3, 1, 2, 1, 9])
        slots = cache.path_device_indices(m.last_device_node).tolist()
        sizes = (cache.total_size(), cache.evictable_size(), cache.protected_size())
        events = events_of(cache)
        evicted = cache.evict(sgl.EvictParams(num_tokens=100)).num_tokens_evicted
        # The backend appends such a value in runs, so its nodes break where a run does:
        # the same pages leave, in another order.
        removed = sorted(h for e in events_of(cache) for h in e.block_hashes)
        runs[name] = (first, second, m.device_prefix_len, slots, sizes, events, evicted)
        runs[name] += (removed, cache.total_size())
    assert runs["TokenCacheRadixCache"] == runs["RadixCache"]
    assert runs["RadixCache"][3] == [1, 2, 1, 2, 3, 1, 2, 1]


def test_a_slot_repeated_inside_one_page_is_still_refused(sgl: SimpleNamespace) -> None:
    """RadixCache takes [5, 5] as one page's values; the native tree cannot hold one slot
    twice in a page (README), so the backend refuses it and changes nothing."""
    import tokencache

    cache = sgl.cache.TokenCacheRadixCache.create_simulated(page_size=2)
    with pytest.raises(tokencache.DuplicateSlotError, match="inside the page"):
        insert(sgl, cache, [1, 2, 5, 5], None)
    assert cache.total_size() == 0
    cache.tree.check_invariants()


def test_kv_events_is_the_recorder_take_events_reads(sgl: SimpleNamespace) -> None:
    """Events taken through cache.kv_events (as SGLang's base class does) are the tree's,
    in order, and equal RadixCache's."""
    got = {}
    for c in (sgl.RadixCache, sgl.cache.TokenCacheRadixCache):
        cache = c.create_simulated(page_size=1, enable_kv_cache_events=True)
        insert(sgl, cache, [1, 2, 3], [10, 20, 30])
        first = cache.kv_events.take()
        cache.reset()
        insert(sgl, cache, [4, 5], [40, 50])
        got[c.__name__] = (first, cache.kv_events.take(), cache.take_events())
    assert got["TokenCacheRadixCache"] == got["RadixCache"]
    assert got["RadixCache"][1] and got["RadixCache"][2] == []
