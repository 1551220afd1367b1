"""The one way to import SGLang in this project (the backend, tokencache-bench, the routing
engine's naive-sglang dispatch, tests/sglang and benches all go through it).

sglang 0.5.23 imports ``torchvision`` unconditionally and PyPI's torchvision wheel needs CUDA, so
on a CPU-only host :mod:`tokencache_sglang.stubs` serves an inert stand-in first (nothing is
stubbed where the real package loads). Where torch sees a GPU, sglang's modules import its CUDA
kernels (``sgl_kernel``) at module level; the caches use none of them, and a GPU machine that
carries sglang installed with --no-deps has none, so there the import runs with
``torch.cuda.is_available`` answering False (as the H200 run of 2026-11-30 did). Process-wide
while it lasts (imports are not thread-safe anyway), and what sglang caches from it stays
(``is_cuda()``, modules' ``_is_cuda``): RadixCache does not use those. Call
:func:`import_sglang` before any ``from sglang ...`` import; it is cheap after the first call.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
    with warnings.catch_warnings(), _cuda_hidden_without_sgl_kernel():
        # Quantization modules warn that CUDA is missing; irrelevant to the caches.
        warnings.simplefilter("ignore")
        require("sglang", extra="sglang")
        return importlib.import_module(module)


@contextmanager
def _cuda_hidden_without_sgl_kernel() -> Iterator[None]:
    """torch.cuda.is_available() is False inside, when torch sees a GPU and sgl_kernel is not
    installed (restored on the way out); otherwise nothing changes."""
    try:
        import torch
    except ImportError:  # require() below names the missing extra
        yield
        return
    if importlib.util.find_spec("sgl_kernel") is not None or not torch.cuda.is_available():
        yield
        return
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_available = real


def sglang_version() -> str:
    """The installed sglang's version, "unknown" when it does not say; ImportError without it."""
    return str(getattr(import_sglang("sglang"), "__version__", "unknown"))
