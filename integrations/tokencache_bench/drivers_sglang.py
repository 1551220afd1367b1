"""Drivers for SGLang 0.5.23's own caches, called the way its scheduler re-admits a request.

A returning request is a new `extend` request to SGLang: match_prefix from the root, lock the
matched node, insert the whole sequence, unlock (cache_finished_req / checkpoint).
"""

from __future__ import annotations

from array import array
from time import perf_counter_ns
from types import SimpleNamespace
from typing import Any

from tokencache_bench.driver import Driver
from tokencache_bench.trace import HandOff, Trace
from tokencache_sglang.sglang_import import import_sglang

SGLANG_OPS = ("match", "lock", "insert", "unlock")


def _mock_allocator() -> SimpleNamespace:
    # The trace's counter allocator never reuses slots, so frees are no-ops.
    return SimpleNamespace(
        device="cpu", free=lambda idx: None, free_segment=lambda idx, start_pos=0: None
    )


class _SGLangDriver(Driver):
    ops = SGLANG_OPS

    def __init__(self, trace: Trace) -> None:
        super().__init__(trace)
        rc = import_sglang()
        from sglang.srt.mem_cache import base_prefix_cache as bpc

        self._key_cls = rc.RadixKey
        self._match_params = bpc.MatchPrefixParams
        self._insert_params = bpc.InsertParams
        self.cache = self._build()

    def _build(self) -> Any:
        raise NotImplementedError

    def _key(self, request: int, end: int) -> Any:
        # A fresh array per call: SGLang's tree may keep the caller's array object.
        ids = array("q")
        ids.frombytes(self.trace.tokens[request][:end].tobytes())
        return self._key_cls(ids)

    def _value(self, request: int, end: int) -> Any:
        import torch

        return torch.from_numpy(self.trace.slots[request][:end])

    def admit(self, request: int) -> None:
        self._run(request, self.trace.prompt_len, 0)

    def handoff(self, h: HandOff) -> tuple[int, ...]:
        return self._run(h.request, h.end, h.start)

    def _run(self, request: int, end: int, inserted: int) -> tuple[int, ...]:
        cache = self.cache
        match_params = self._match_params(key=self._key(request, end))
        insert_params = self._insert_params(
            key=self._key(request, end), value=self._value(request, end), inserted_len=inserted
        )
        t0 = perf_counter_ns()
        m = cache.match_prefix(match_params)
        t1 = perf_counter_ns()
        lock = cache.lock(m.last_device_node)
        t2 = perf_counter_ns()
        cache.insert(insert_params)
        t3 = perf_counter_ns()
        cache.unlock(lock)
        t4 = perf_counter_ns()
        return (t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    def cached_tokens(self) -> int:
        size = self.cache.total_size()
        # UnifiedRadixCache reports (full, swa).
        return int(size[0] if isinstance(size, tuple) else size)


class SGLangRadixCache(_SGLangDriver):
    name = "sglang RadixCache (Python)"
    python_heap = True

    def _build(self) -> Any:
        rc = import_sglang()
        return rc.RadixCache.create_simulated(mock_allocator=_mock_allocator(), page_size=1)


class _SGLangUnified(_SGLangDriver):
    backend = ""

    def _build(self) -> Any:
        import_sglang()
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=_mock_allocator(),
            page_size=1,
            tree_components=(ComponentType.FULL,),
            tree_core_backend=self.backend,
        )
        cache = UnifiedRadixCache(params)
        core = type(cache.tree_core).__name__
        # SGLang silently falls back to the Python core; a mislabelled line would mislead.
        expected = "RustUnifiedTreeCore" if self.backend == "rust" else "UnifiedTreeCore"
        if core != expected:
            raise RuntimeError(f"asked for the {self.backend} tree core, SGLang built {core}")
        return cache


class SGLangUnifiedRust(_SGLangUnified):
    name = "sglang UnifiedRadixCache (Rust core)"
    backend = "rust"


class SGLangUnifiedPython(_SGLangUnified):
    name = "sglang UnifiedRadixCache (Python core)"
    backend = "python"
    python_heap = True


class TokencacheSGLangBackend(_SGLangDriver):
    """tokencache behind SGLang's cache interface (tokencache_sglang.cache), called like SGLang."""

    name = "tokencache via tokencache_sglang.cache"

    def _build(self) -> Any:
        from tokencache_sglang.cache import TokenCacheRadixCache

        return TokenCacheRadixCache.create_simulated(mock_allocator=_mock_allocator(), page_size=1)
