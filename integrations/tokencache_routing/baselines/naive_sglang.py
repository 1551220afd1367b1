"""The naive dispatcher through SGLang's own ``RadixCache`` (``dispatch="naive-sglang"``).

The same protocol as ``naive.py`` (a request leaving a model is cached like a finished request;
coming back it is re-admitted as new: match from the root, lock, prefill the rest, plus the
synchronous barrier), but every tree operation goes through sglang 0.5.23's Python
``RadixCache``, the way an SGLang scheduler drives it:

- admission: ``match_prefix(MatchPrefixParams(RadixKey(array('q'))))``, ``inc_lock_ref`` on the
  matched node, ``path_device_indices`` for the prefix slots (``req.prefix_indices``);
- leaving a model (``cache_finished_req``): ``insert(InsertParams(key, value))``, the duplicate
  slots freed, ``dec_lock_ref``;
- memory pressure: ``evict(EvictParams(n))``; SGLang hands the evicted leaves' slots to its
  allocator, here :class:`PoolAllocator`, which returns them to this model's ``KVPool``.

Each model side keeps its own ``RadixCache`` over its own pool (per-model trees, as for the
tokencache dispatch). Bookkeeping time covers the key construction, the cache calls and the
slot-index conversions (what a scheduler pays per admission), not the allocator's frees.

sglang is imported on first use (``tokencache_sglang.sglang_import.import_sglang()``), so the
other dispatches work without it.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tokencache_models import CausalLM, KVPool

from ..core.kv import ModelSide
from .naive import NaiveKV

_SGL: SimpleNamespace | None = None


def sglang_api() -> SimpleNamespace:
    """SGLang's RadixCache API, imported once (torchvision stubbed first on CPU-only hosts)."""
    global _SGL
    if _SGL is None:
        try:
            from tokencache_sglang.sglang_import import import_sglang

            import_sglang()
            from sglang.srt.mem_cache.base_prefix_cache import (
                EvictParams,
                InsertParams,
                MatchPrefixParams,
            )
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        except Exception as exc:
            raise ImportError(
                "dispatch='naive-sglang' needs sglang==0.5.23 importable (see "
                f"requirements/sglang*.txt and docs on the CPU install): {type(exc).__name__}: "
                f"{exc}"
            ) from exc
        _SGL = SimpleNamespace(
            EvictParams=EvictParams,
            InsertParams=InsertParams,
            MatchPrefixParams=MatchPrefixParams,
            CacheInitParams=CacheInitParams,
            RadixCache=RadixCache,
            RadixKey=RadixKey,
        )
    return _SGL


def _key(tokens: np.ndarray) -> Any:
    """A fresh RadixKey over an array('q') copy (SGLang may keep the array object)."""
    a = array("q")
    a.frombytes(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    return _SGL.RadixKey(a)  # type: ignore[union-attr]


class PoolAllocator:
    """What SGLang's RadixCache calls on its token allocator, forwarded to our KVPool."""

    def __init__(self, pool: KVPool, timer: Callable[[], float] = time.perf_counter) -> None:
        self.pool = pool
        self.timer = timer  # the side's bookkeeping timer, so the two subtract cleanly
        self.device = torch.device("cpu")
        self.freed = 0  # slots handed back by the cache (eviction)
        self.free_s = 0.0  # time inside those frees (not bookkeeping: the pool's own work)

    def free(self, free_index: torch.Tensor) -> None:
        t0 = self.timer()
        n = int(free_index.numel())
        if n:
            self.pool.free(free_index.to(torch.int64))
        self.freed += n
        self.free_s += self.timer() - t0

    def free_segment(self, free_index: torch.Tensor, start_pos: int = 0) -> None:
        self.free(free_index)

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        for free_index, start_pos in segments:
            self.free_segment(free_index, start_pos=start_pos)

    free_full_segments = free_segments


class SGLangSide(ModelSide):
    """A model side whose prefix cache is SGLang's RadixCache over this side's KVPool
    (``cache``); it builds no tokencache tree (``tree`` is not set)."""

    def __init__(
        self, name: str, model: CausalLM, pool: KVPool, page_size: int = 1, events: bool = False
    ) -> None:
        self._setup(name, model, pool, page_size)  # no tokencache tree; events: SGLang's own
        sgl = sglang_api()
        self.allocator = PoolAllocator(pool, lambda: self.timer())
        self.cache = sgl.RadixCache(
            sgl.CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.allocator,
                page_size=page_size,
            )
        )

    def evict(self, n: int) -> int:
        free0 = self.allocator.free_s
        with self.bookkeeping("evict"):
            res = self.cache.evict(_SGL.EvictParams(num_tokens=n))  # type: ignore[union-attr]
        self.bookkeeping_s -= self.allocator.free_s - free0  # the pool's own work
        return int(res.num_tokens_evicted)

    def cached_prefix_len(self, tokens: np.ndarray) -> int:
        """What SGLang's cache holds of tokens (the scheduler's hold-back asks)."""
        with self.bookkeeping("match"):
            m = self.cache.match_prefix(_SGL.MatchPrefixParams(key=_key(tokens)))  # type: ignore[union-attr]
        return int(m.device_prefix_len)

    def cached_size(self) -> int:
        return int(self.cache.total_size())

    def pinned_size(self) -> int:
        return int(self.cache.protected_size())

    def check_invariants(self) -> None:
        """SGLang's cache keeps its own sizes: evictable + protected == total."""
        c = self.cache
        if c.evictable_size() + c.protected_size() != c.total_size():
            raise AssertionError("SGLang RadixCache: evictable + protected != total")


class NaiveSGLangKV(NaiveKV):
    """One request's KV in one model, admitted through SGLang's RadixCache at every return.
    The private slot row and its bookkeeping are NaiveKV's; only the tree calls differ."""

    needs_attach_each_time = True

    def __init__(self, side: SGLangSide) -> None:
        super().__init__(side)
        self.side: SGLangSide = side
        self.node: Any = None  # the locked last_device_node (req.last_node)

    def attach(self, seq: np.ndarray) -> None:
        """Admitted as new: match seq[:-1] from the root, lock, read the prefix slots."""
        sgl = _SGL
        cache = self.side.cache
        # Synchronised on CUDA: SGLang's device work counts.
        with self.side.bookkeeping("match"):
            m = cache.match_prefix(sgl.MatchPrefixParams(key=_key(seq[:-1])))  # type: ignore[union-attr]
            node = m.last_device_node
        with self.side.bookkeeping("lock"):
            cache.inc_lock_ref(node)
        with self.side.bookkeeping("match"):  # the matched slots, read out as SGLang does
            prefix = cache.path_device_indices(node).cpu().numpy()
        self.node = node
        self._take_row(prefix)
        self._prefix_len = len(prefix)

    def release(self, seq: np.ndarray) -> None:
        if self.node is None:
            return
        sgl = _SGL
        side = self.side
        cache = side.cache
        n = self._n
        row = self.slots()
        aligned = n - n % side.page_size
        with side.bookkeeping("insert"):
            res = cache.insert(
                sgl.InsertParams(  # type: ignore[union-attr]
                    key=_key(seq[:aligned]),
                    value=torch.from_numpy(row[:aligned].copy()),
                )
            )
        with side.bookkeeping("unlock"):
            cache.dec_lock_ref(self.node)
        # Slots the tree already held for [prefix_len, res.prefix_len) are duplicates; a
        # partial last page never enters the tree.
        side.free(row[self._prefix_len : res.prefix_len].copy())
        side.free(row[aligned:n].copy())
        self.node = None
        self._prefix_len = 0
        self._drop_row()
