"""The implementations the benchmark knows, in run order, and how to build each driver."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from tokencache_bench.driver import Driver


@dataclass(frozen=True)
class Impl:
    key: str
    module: str
    cls: str
    slow: bool  # pure-Python tree: replays a request subset at large L
    needs: str  # module that must import for this implementation to run


# Run order matters for the RSS figures: native trees first, before Python trees leave
# freed-but-resident arenas behind.
IMPLS: tuple[Impl, ...] = (
    Impl(
        "cursors", "tokencache_bench.drivers_tokencache", "TokencacheCursors", False, "tokencache"
    ),
    Impl(
        "extend_many",
        "tokencache_bench.drivers_tokencache",
        "TokencacheExtendMany",
        False,
        "tokencache",
    ),
    Impl(
        "tc_radix",
        "tokencache_bench.drivers_tokencache",
        "TokencacheRadixTree",
        False,
        "tokencache",
    ),
    Impl(
        "tc_sglang",
        "tokencache_bench.drivers_sglang",
        "TokencacheSGLangBackend",
        False,
        "tokencache_sglang.cache",
    ),
    Impl(
        "sgl_unified_rust", "tokencache_bench.drivers_sglang", "SGLangUnifiedRust", False, "sglang"
    ),
    Impl("sgl_radix", "tokencache_bench.drivers_sglang", "SGLangRadixCache", True, "sglang"),
    Impl(
        "sgl_unified_python",
        "tokencache_bench.drivers_sglang",
        "SGLangUnifiedPython",
        True,
        "sglang",
    ),
)


def factory(impl: Impl) -> type[Driver]:
    """The driver class (imported on demand: the SGLang drivers import sglang)."""
    cls: type[Driver] = getattr(importlib.import_module(impl.module), impl.cls)
    return cls
