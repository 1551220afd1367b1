"""SGLang prefix cache backed by the native ``tokencache.RadixTree``.

Behaves like sglang 0.5.23's ``RadixCache`` (page-aligned matching, node split on match,
extra_key/cache_salt namespaces, whole-leaf eviction through the allocator, exact sizes), but
every tree lock a request takes is a native ``Cursor``: a running request's ``checkpoint`` appends
only the tokens computed since its previous checkpoint, O(new tokens) instead of a walk from
the root.

Node handles SGLang stores (``req.last_node``, ``MatchResult.last_device_node``) are native
``tokencache.Node`` objects; SGLang only hands them back to this cache.
"""

from __future__ import annotations

import dataclasses
import json
import time
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokencache_sglang.sglang_import import import_sglang

import_sglang()  # before the first sglang import (stubs torchvision where it cannot load)

from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)

import tokencache

from . import events as kv_events

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

SUPPORTED_EVICTION_POLICIES = ("lru", "lfu", "fifo")


class UnsupportedConfigError(ValueError):
    """An SGLang configuration this backend cannot serve; raised at start-up."""


@dataclasses.dataclass
class CursorLock(TreeLock):
    """A request's tree lock: the cursor pins ``node`` and remembers the request's place."""

    cursor: tokencache.Cursor | None = None
    # The checkpoint split at the prompt boundary was done while this lock was held; the
    # pinned path cannot be evicted or merged, so it stays split.
    prompt_split: bool = False


def namespace_of(extra_key: str | None, cache_salt: str | None) -> str | None:
    """One string per (extra_key, cache_salt) pair, None for the default namespace.

    RadixKey keys children by the pair, so "" and None are distinct extra_keys; JSON keeps
    every pair distinct.
    """
    cache_salt = cache_salt or None  # RadixKey normalises "" to None
    if extra_key is None and cache_salt is None:
        return None
    return json.dumps([extra_key, cache_salt])


def token_array(token_ids: Any, n: int) -> np.ndarray:
    """The first n token ids as int64, without a copy when they are an array('q')."""
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if isinstance(token_ids, array) and token_ids.itemsize == 8:
        # A view: the native call copies it, and the view dies before SGLang resizes the array.
        return np.frombuffer(token_ids, dtype=np.int64, count=n)
    return np.asarray(token_ids[:n], dtype=np.int64)


class TokenCacheRadixCache(BasePrefixCache):
    """``--radix-cache-backend tokencache``: a drop-in for sglang's RadixCache."""

    def __init__(self, params: CacheInitParams) -> None:
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.is_eagle = params.is_eagle
        self.eviction_policy = params.eviction_policy.lower()
        if self.is_eagle:
            # EAGLE keys the tree by token bigrams; the native tree keys single tokens.
            raise UnsupportedConfigError(
                "tokencache backend: EAGLE speculative decoding (bigram radix keys) is not "
                "supported; drop --radix-cache-backend tokencache or the EAGLE algorithm."
            )
        if self.eviction_policy not in SUPPORTED_EVICTION_POLICIES:
            raise UnsupportedConfigError(
                f"tokencache backend: --radix-eviction-policy {self.eviction_policy!r} is not "
                f"supported; use one of {', '.join(SUPPORTED_EVICTION_POLICIES)}."
            )
        if params.eviction_policy_config:
            raise UnsupportedConfigError(
                "tokencache backend: --radix-eviction-policy-config is not supported "
                f"(got {params.eviction_policy_config!r})."
            )
        # Slot tensors live where the allocator's do (RadixCache's rule, CPU otherwise).
        dev = getattr(self.token_to_kv_pool_allocator, "device", None)
        self.device = torch.device(dev if isinstance(dev, (str, torch.device)) else "cpu")
        self._events_enabled = params.enable_kv_cache_events and not self.disable
        self.tree = tokencache.RadixTree(
            page_size=self.page_size,
            eviction_policy=self.eviction_policy,
            enable_events=self._events_enabled,
        )
        self._empty_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        # RadixCache's attribute, SGLang's recorder class (disabled: every call a no-op).
        self.kv_events: kv_events.TreeEventRecorder = kv_events.TreeEventRecorder(
            self.tree,
            enabled=self._events_enabled,
            page_size=self.page_size,
            dynamo_format=params.dynamo_kv_event_format,
            lora_names=params.kv_event_lora_names,
        )
        self._seeded: set[str] = set()
        if params.enable_metrics:
            self.init_metrics_collector()
        self.reset()

    @classmethod
    def create_simulated(
        cls,
        disable: bool = False,
        mock_allocator: Any | None = None,
        page_size: int = 1,
        enable_kv_cache_events: bool = False,
        dynamo_kv_event_format: bool = False,
        kv_event_lora_names: Any | None = None,
        eviction_policy: str = "lru",
        req_to_token_pool: Any | None = None,
    ) -> TokenCacheRadixCache:
        """A cache without real memory pools, like ``RadixCache.create_simulated`` (same
        arguments, in its order; eviction_policy and req_to_token_pool are ours)."""
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        return cls(
            CacheInitParams(
                disable=disable,
                req_to_token_pool=req_to_token_pool,
                token_to_kv_pool_allocator=mock_allocator,
                page_size=page_size,
                eviction_policy=eviction_policy,
                enable_kv_cache_events=enable_kv_cache_events,
                dynamo_kv_event_format=dynamo_kv_event_format,
                kv_event_lora_names=kv_event_lora_names,
            )
        )

    # ----- conversions -----

    def _to_device(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)

    @staticmethod
    def _to_numpy(values: torch.Tensor) -> np.ndarray:
        return values.detach().to(device="cpu", dtype=torch.int64).numpy()

    def _aligned_len(self, n: int) -> int:
        return int(n - n % self.page_size)

    @property
    def root_node(self) -> tokencache.Node:
        return self.tree.root

    # ----- BasePrefixCache contract -----

    def reset(self) -> None:
        # SGLang clears the allocator itself after reset(); the returned slots are not ours.
        self.tree.reset()
        root = self.tree.root
        self._empty_match_result = MatchResult(
            device_prefix_len=0,
            last_device_node=root,
            last_host_node=root,
            best_match_node=root,
        )

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if self.disable:
            return self._empty_match_result
        n = self._aligned_len(len(key))
        if n == 0:
            return self._empty_match_result
        result = self.tree.match_prefix(
            token_array(key.token_ids, n), self._namespace(key.extra_key, key.cache_salt)
        )
        node = result.node
        return MatchResult(
            device_prefix_len=result.length,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    def touch_prefix(self, key: RadixKey) -> None:
        # RadixCache implements this as a match (which may split); do the same.
        self.match_prefix(MatchPrefixParams(key=key))

    def insert(self, params: InsertParams) -> InsertResult:
        if self.disable:
            return InsertResult(prefix_len=0)
        key = params.key
        n = self._aligned_len(len(key))
        if n == 0:
            return InsertResult(prefix_len=0, last_device_node=self.tree.root)
        tokens = token_array(key.token_ids, n)
        # Without a value RadixCache stores the token ids themselves (a debug fallback).
        slots = tokens.copy() if params.value is None else self._to_numpy(params.value[:n])
        namespace = self._namespace(key.extra_key, key.cache_salt)
        try:
            result = self.tree.insert(tokens, slots, namespace, inserted_len=params.inserted_len)
        except tokencache.DuplicateSlotError:
            # A value repeating a slot (the token-id fallback above: [1, 2, 1, 2]). The tree
            # refuses that in one call, and changed nothing; RadixCache stores it as given.
            return self._insert_repeating(tokens, slots, namespace, params.inserted_len)
        return InsertResult(prefix_len=result.prefix_len, last_device_node=result.node)

    def _insert_repeating(
        self, tokens: np.ndarray, slots: np.ndarray, namespace: str | None, inserted_len: int
    ) -> InsertResult:
        """insert() of a value that repeats slots: the matched prefix, then the rest appended
        in page-aligned runs that each hold a slot once (a cursor checks one call's slots).
        A slot repeated inside one page cannot be split this way and is still refused."""
        match = self.tree.match_prefix(tokens, namespace)
        cursor = self.tree.cursor_at(match.node)
        try:
            page = self.page_size
            start, seen = match.length, set[int]()
            for at in range(match.length, len(tokens), page):
                page_slots = slots[at : at + page].tolist()
                if len(set(page_slots)) < len(page_slots):
                    raise tokencache.DuplicateSlotError(
                        f"insert: a slot repeats inside the page at token {at}; the native "
                        "tree holds each slot once per page"
                    )
                if seen.intersection(page_slots):
                    cursor.extend(tokens[start:at], slots[start:at])
                    start, seen = at, set()
                seen.update(page_slots)
            cursor.extend(tokens[start:], slots[start:])
            cursor.record_hits(inserted_len)
            node = cursor.node
        finally:
            cursor.release()  # whole pages only: no uncached tail to free
        return InsertResult(prefix_len=match.length, last_device_node=node)

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        if self.disable:
            return
        kv = req.kv
        if kv.swa_evict_floor > 0:
            raise UnsupportedConfigError("tokencache backend: SWA eviction floors are unsupported")
        # RadixCache keys full_untruncated_fill_ids[:up_to], page-aligned.
        key_len = self._aligned_len(min(up_to, len(req.full_untruncated_fill_ids)))
        namespace = self._namespace(req.extra_key, req.cache_salt)
        lock = req.lock
        if (
            isinstance(lock, CursorLock)
            and lock.cursor is not None
            and lock.cursor.namespace == namespace
            and lock.cursor.length == kv.cache_protected_len <= key_len
        ):
            self._checkpoint_by_cursor(req, lock, lock.cursor, key_len)
        else:
            # First checkpoint after a root-anchored lock, or an unusual rewind: do what
            # RadixCache does (insert, re-match, move the lock); the new lock is a cursor.
            self._checkpoint_by_insert(req, key_len, namespace)

    def _checkpoint_by_cursor(
        self, req: Req, lock: CursorLock, cursor: tokencache.Cursor, key_len: int
    ) -> None:
        kv = req.kv
        start = kv.cache_protected_len
        all_tokens = req.full_untruncated_fill_ids
        if kv.cache_inserted_len < start:
            # RadixCache re-inserts from the root with inserted_len: the matched prefix's nodes
            # past it count an LFU hit (the first checkpoint after admission does this).
            cursor.record_hits(kv.cache_inserted_len)
        if key_len > start:
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            dedup = cursor.extend(
                token_array(all_tokens, key_len)[start:], self._to_numpy(row[start:key_len])
            )
            if dedup is not None and len(dedup) > 0:
                # The tree already held these tokens: free the request's copies and point
                # the row at the tree's (RadixCache frees row[cache_protected_len:prefix_len]).
                positions = dedup.positions
                first = int(positions[0])
                self.token_to_kv_pool_allocator.free_segment(
                    self._to_device(dedup.freed), start_pos=first
                )
                self.req_to_token_pool.write(
                    (kv.req_pool_idx, self._to_device(positions)),
                    self._to_device(dedup.slots).to(row.dtype),
                )
        kv.cache_inserted_len = max(kv.cache_inserted_len, key_len)
        prompt_len = self._aligned_len(len(req.origin_input_ids))
        if not lock.prompt_split and 0 < prompt_len < key_len:
            # RadixCache splits the leaf at the prompt boundary so eviction can drop the output
            # without the prompt. Once per lock: the pinned path stays split.
            self.tree.match_prefix(token_array(all_tokens, prompt_len), cursor.namespace)
            lock.prompt_split = True
        # RadixCache's checkpoint re-matches the whole key, so every node on the request's path
        # becomes most recently used, which decides later LRU eviction order.
        # The cursor does that in O(1) (ancestors inherit the stamp when their children leave).
        cursor.touch()
        lock.node = cursor.node
        req.last_node = cursor.node
        kv.cache_protected_len = cursor.length

    def _checkpoint_by_insert(self, req: Req, key_len: int, namespace: str | None) -> None:
        kv = req.kv
        tokens = token_array(req.full_untruncated_fill_ids, key_len)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        slots = self._to_numpy(row[:key_len])
        inserted = kv.cache_inserted_len
        prefix_len = self.tree.insert(tokens, slots, namespace, inserted_len=inserted).prefix_len
        kv.cache_inserted_len = max(kv.cache_inserted_len, key_len)
        prompt_len = self._aligned_len(len(req.origin_input_ids))
        if 0 < prompt_len < key_len:
            self.tree.match_prefix(tokens[:prompt_len], namespace)
        protected = kv.cache_protected_len
        if prefix_len > protected:
            self.token_to_kv_pool_allocator.free_segment(
                row[protected:prefix_len], start_pos=protected
            )
        match = self.tree.match_prefix(tokens, namespace)
        new_slots = match.slots
        if len(new_slots) > protected:
            self.req_to_token_pool.write(
                (kv.req_pool_idx, slice(protected, len(new_slots))),
                self._to_device(new_slots[protected:]).to(row.dtype),
            )
        kv.cache_protected_len = len(new_slots)
        self.unlock(req.lock)
        req.lock = self.lock(match.node)
        if isinstance(req.lock, CursorLock):
            req.lock.prompt_split = 0 < prompt_len < key_len
        req.last_node = match.node

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start_time = time.perf_counter()
        freed = self.tree.evict(params.num_tokens)
        if len(freed):
            # Whole leaves of whole pages: one page-exact segment.
            self.token_to_kv_pool_allocator.free_segment(self._to_device(freed), start_pos=0)
        self.update_eviction_metrics(len(freed), start_time)
        return EvictResult(num_tokens_evicted=len(freed))

    def inc_lock_ref(self, node: tokencache.Node) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        # RadixCache reports the change of the evictable size.
        return IncLockRefResult(delta=-self.tree.lock(node))

    def dec_lock_ref(
        self, node: tokencache.Node, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        return DecLockRefResult(delta=self.tree.unlock(node))

    def lock(self, node: tokencache.Node) -> TreeLock | None:
        if self.disable:
            return TreeLock(node, DecLockRefParams())
        return CursorLock(node, DecLockRefParams(), cursor=self.tree.cursor_at(node))

    def unlock(self, lock: TreeLock | None) -> None:
        if lock is None:
            return
        if isinstance(lock, CursorLock):
            cursor, lock.cursor = lock.cursor, None
            if cursor is None:
                raise tokencache.LockStateError("this tree lock was already released")
            # Checkpoints extend by whole pages only, so the cursor holds no uncached tail.
            cursor.release()
        elif not self.disable:
            self.dec_lock_ref(lock.node, lock.receipt)

    def path_device_indices(self, node: tokencache.Node) -> torch.Tensor:
        if node.is_root:
            return self._empty_indices
        return self._to_device(self.tree.path_slots(node))

    def dfs_weight_order(self, node_handles: Any) -> list[int]:
        # Native: walks only the paths above the given nodes (SGLang walks the whole tree).
        return self.tree.dfs_weight_order(list(node_handles))

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def supports_fast_match_prefix(self) -> bool:
        # Like RadixCache: a match may split nodes, so the scheduler must not match every
        # waiting request on every step.
        return False

    def evictable_size(self) -> int:
        return 0 if self.disable else self.tree.evictable_size()

    def protected_size(self) -> int:
        return 0 if self.disable else self.tree.protected_size()

    def full_evictable_size(self) -> int:
        # Every slot here is full-attention KV (what UnifiedRadixCache reports too).
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        return self.tree.total_size()

    def all_values_flatten(self) -> torch.Tensor:
        return self._to_device(self.tree.all_slots())

    def pretty_print(self) -> None:
        print(self.tree.pretty_print())
        print(f"#tokens: {self.total_size()}")

    def take_events(self) -> list[Any]:
        return self.kv_events.take()

    def _namespace(self, extra_key: str | None, cache_salt: str | None) -> str | None:
        """The tree namespace of a key; a salted one's events chain from SGLang's salt seed."""
        namespace = namespace_of(extra_key, cache_salt)
        if self._events_enabled and namespace is not None and namespace not in self._seeded:
            salt = cache_salt or None
            self.tree.set_event_seed(namespace, kv_events.salt_seed(salt) if salt else None)
            self._seeded.add(namespace)
        return namespace
