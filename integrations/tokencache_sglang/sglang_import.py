"""The one way to import SGLang in this project (the backend, tokencache-bench, the routing
engine's naive-sglang dispatch, tests/sglang and benches all go through it).

sglang 0.5.23 imports ``torchvision`` unconditionally and PyPI's torchvision wheel needs CUDA, so
on a CPU-only host :mod:`tokencache_sglang.stubs` serves an inert stand-in first (nothing is
stubbed where the real package loads). Call :func:`import_sglang` before any ``from sglang ...``
import; it is cheap after the first call.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

from tokencache_extras import require
from tokencache_sglang import stubs


def import_sglang(module: str = "sglang.srt.mem_cache.radix_cache") -> ModuleType:
    """Make ``import sglang`` work on this host and return ``module`` (SGLang's radix_cache by
    default). Raises :class:`tokencache_extras.MissingExtra` (an ImportError) naming the
    ``sglang`` extra when sglang is not installed or does not load."""
    if module in sys.modules:
        return sys.modules[module]
    stubs.install()
    with warnings.catch_warnings():
        # Quantization modules warn that CUDA is missing; irrelevant to the caches.
        warnings.simplefilter("ignore")
        require("sglang", extra="sglang")
        return importlib.import_module(module)


def sglang_version() -> str:
    """The installed sglang's version, "unknown" when it does not say; ImportError without it."""
    return str(getattr(import_sglang("sglang"), "__version__", "unknown"))
