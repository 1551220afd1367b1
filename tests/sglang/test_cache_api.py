"""The rest of the BasePrefixCache surface: construction checks, events, reset, printing."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest


def make(sgl: SimpleNamespace, **params: object) -> object:
    from sgl_harness import RecordingAllocator

    page_size = int(params.pop("page_size", 4))
    return sgl.cache.TokenCacheRadixCache(
        sgl.CacheInitParams(
            disable=bool(params.pop("disable", False)),
            req_to_token_pool=None,
            token_to_kv_pool_allocator=RecordingAllocator(page_size),
            page_size=page_size,
            **params,
        )
    )


def insert(sgl: SimpleNamespace, cache: object, tokens: list[int], first_slot: int, **ns: str):
    key = sgl.RadixKey(array("q", tokens), ns.get("extra_key"), cache_salt=ns.get("cache_salt"))
    value = sgl.torch.arange(first_slot, first_slot + len(tokens))
    return cache.insert(sgl.InsertParams(key=key, value=value))


@pytest.mark.parametrize("policy", ["slru", "priority", "mru", "filo", "tlru"])
def test_unsupported_policy_raises_at_construction(sgl: SimpleNamespace, policy: str) -> None:
    with pytest.raises(sgl.cache.UnsupportedConfigError, match=policy):
        make(sgl, eviction_policy=policy)


def test_policy_config_raises(sgl: SimpleNamespace) -> None:
    with pytest.raises(sgl.cache.UnsupportedConfigError, match="policy-config"):
        make(sgl, eviction_policy_config={"protected_threshold": 3})


def test_kv_events(sgl: SimpleNamespace) -> None:
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    cache = make(sgl, enable_kv_cache_events=True)
    assert cache.take_events() == [AllBlocksCleared()]
    insert(sgl, cache, list(range(10)), 100, extra_key="lora", cache_salt="salt")
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == 2 and stored.token_ids == list(range(8))
    assert stored.block_size == 4 and stored.cache_salt == "salt"
    cache.evict(sgl.EvictParams(num_tokens=1))
    (removed,) = cache.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]


def test_events_off_by_default(sgl: SimpleNamespace) -> None:
    cache = make(sgl)
    insert(sgl, cache, list(range(8)), 0)
    assert cache.take_events() == []


def test_reset_drops_everything(sgl: SimpleNamespace) -> None:
    cache = make(sgl)
    insert(sgl, cache, list(range(16)), 0)
    node = cache.match_prefix(
        sgl.MatchPrefixParams(key=sgl.RadixKey(array("q", range(8))))
    ).last_device_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 8
    cache.reset()
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.all_values_flatten().numel() == 0
    assert cache.path_device_indices(cache.root_node).numel() == 0


def test_namespaces_do_not_share(sgl: SimpleNamespace) -> None:
    cache = make(sgl)
    insert(sgl, cache, list(range(8)), 0)
    for ns in ({"extra_key": ""}, {"extra_key": "a"}, {"cache_salt": "s"}):
        key = sgl.RadixKey(
            array("q", range(8)), ns.get("extra_key"), cache_salt=ns.get("cache_salt")
        )
        assert cache.match_prefix(sgl.MatchPrefixParams(key=key)).device_prefix_len == 0
        assert insert(sgl, cache, list(range(8)), 100, **ns).prefix_len == 0
    # An empty salt is no salt (RadixKey normalises it).
    key = sgl.RadixKey(array("q", range(8)), cache_salt="")
    assert cache.match_prefix(sgl.MatchPrefixParams(key=key)).device_prefix_len == 8
    assert cache.total_size() == 32


def test_pretty_print_and_touch(sgl: SimpleNamespace, capsys: pytest.CaptureFixture) -> None:
    cache = make(sgl)
    insert(sgl, cache, list(range(12)), 0)
    nodes = cache.tree.node_count()
    cache.touch_prefix(sgl.RadixKey(array("q", range(6))))  # like a match: splits at 4
    assert cache.tree.node_count() == nodes + 1
    cache.pretty_print()
    assert "#tokens: 12" in capsys.readouterr().out
    assert cache.dfs_weight_order([cache.root_node]) == [0]


def test_lock_is_a_cursor_and_releases_once(sgl: SimpleNamespace) -> None:
    import tokencache

    cache = make(sgl)
    insert(sgl, cache, list(range(16)), 0)
    node = cache.match_prefix(
        sgl.MatchPrefixParams(key=sgl.RadixKey(array("q", range(16))))
    ).last_device_node
    lock = cache.lock(node)
    assert isinstance(lock, sgl.cache.CursorLock) and lock.cursor.node == node
    assert (cache.evictable_size(), cache.protected_size()) == (0, 16)
    cache.unlock(lock)
    assert (cache.evictable_size(), cache.protected_size()) == (16, 0)
    with pytest.raises(tokencache.LockStateError):
        cache.unlock(lock)
