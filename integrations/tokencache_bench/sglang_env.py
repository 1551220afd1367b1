"""Import SGLang's cache classes on a CPU-only machine, once per process."""

from __future__ import annotations

import importlib
from types import ModuleType


def load_sglang() -> ModuleType:
    """Return sglang.srt.mem_cache.radix_cache after making `import sglang` possible here."""
    # sglang imports torchvision unconditionally; the project's stub stands in for it.
    from tokencache_sglang.stubs import install

    install()
    import warnings

    with warnings.catch_warnings():
        # Quantization modules warn that CUDA is missing; irrelevant to the caches.
        warnings.simplefilter("ignore")
        return importlib.import_module("sglang.srt.mem_cache.radix_cache")


def sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))
