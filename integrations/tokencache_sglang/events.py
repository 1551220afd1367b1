"""KV events exactly as SGLang publishes them.

The native tree chains SGLang's page digests (SHA-256 of the previous digest and the page's
little-endian u32 ids; salted namespaces seeded as SGLang seeds them). This module replays the
tree's events through SGLang's own ``KVCacheEventRecorder`` so that everything above the digests
(one BlockStored per page, coalescing, parent links, LoRA names, dynamo's namespaced hashes)
is SGLang's code, not a copy of it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from typing import Any

from tokencache_sglang.sglang_import import import_sglang

import_sglang()  # before the first sglang import (stubs torchvision where it cannot load)

from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixKey

import tokencache


def salt_seed(cache_salt: str) -> bytes:
    """The digest SGLang chains a salted namespace's first event page from."""
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).digest()


class _EventNode:
    """The fields KVCacheEventRecorder reads off a radix node, for one event."""

    __slots__ = ("event_hash_value", "hash_value", "key", "parent")

    def __init__(self, key: RadixKey, parent: _EventNode | None, digests: list[bytes]) -> None:
        self.key = key
        self.parent = parent
        self.hash_value = [d.hex() for d in digests]
        self.event_hash_value = self.hash_value


_ROOT = _EventNode(RadixKey(array("q")), None, [])


class TreeEventRecorder(KVCacheEventRecorder):  # type: ignore[misc]  # sglang is untyped
    """SGLang's recorder as RadixCache's ``kv_events``, fed from the native tree.

    The tree records its events natively; they are replayed here, in order, before anything
    else is recorded or taken, so ``cache.kv_events.take()`` and ``cache.take_events()`` give
    what RadixCache's recorder would hold at that moment.
    """

    def __init__(
        self,
        tree: tokencache.RadixTree,
        *,
        enabled: bool,
        page_size: int,
        dynamo_format: bool = False,
        lora_names: Any = None,
    ) -> None:
        super().__init__(
            enabled=enabled, page_size=page_size, dynamo_format=dynamo_format, lora_names=lora_names
        )
        self.tree = tree

    def flush(self) -> None:
        """Replay the tree's pending events (taking them drains the tree: no re-entry)."""
        if self.enabled:
            replay(self, self.tree.take_events(), self.page_size)

    def record_all_cleared(self) -> None:
        self.flush()
        super().record_all_cleared()

    def take(self) -> list[Any]:
        self.flush()
        events: list[Any] = super().take()
        return events


def replay(
    recorder: KVCacheEventRecorder, events: list[tokencache.KVEvent], page_size: int
) -> None:
    """Record the tree's events, in order, on SGLang's recorder."""
    for event in events:
        if event.kind == "cleared":
            KVCacheEventRecorder.record_all_cleared(recorder)  # not the flushing override
            continue
        extra_key, cache_salt = (
            (None, None) if event.namespace is None else json.loads(event.namespace)
        )
        digests = event.page_digests
        tokens = event.token_ids or [0] * (len(digests) * page_size)  # removals need a length
        key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)
        parent: Any = _ROOT
        if event.parent_digest is not None:
            parent_key = RadixKey(array("q", [0]), extra_key, cache_salt=cache_salt)
            parent = _EventNode(parent_key, _ROOT, [event.parent_digest])
        node = _EventNode(key, parent, digests)
        if event.kind == "stored":
            recorder.record_store(node)
        else:
            recorder.record_remove(node)
