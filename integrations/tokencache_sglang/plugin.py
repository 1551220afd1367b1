"""SGLang plugin: registers ``--radix-cache-backend tokencache``.

SGLang loads the ``sglang.srt.plugins`` entry point ``tokencache`` in each of its processes
(scheduler, detokenizer, ...) and calls :func:`register`, which warns once per process when the
installed SGLang is not the version the backend is tested with.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from tokencache_sglang.sglang_import import import_sglang, sglang_version

import_sglang()  # a no-op inside SGLang's processes; stubs torchvision when imported elsewhere

from sglang.srt.mem_cache.registry import (
    get_radix_cache_factory,
    register_radix_cache_backend,
)

from tokencache_sglang.cache import (
    SUPPORTED_EVICTION_POLICIES,
    TokenCacheRadixCache,
    UnsupportedConfigError,
)

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

BACKEND_NAME = "tokencache"
# The SGLang release the backend is tested against (tests/sglang; the `sglang` extra pins it).
TESTED_SGLANG_VERSION = "0.5.23"


class UntestedSGLangVersionWarning(UserWarning):
    """The installed SGLang is not the release the backend is tested with."""


def warn_if_untested(installed: str) -> None:
    """Warn when ``installed`` (an SGLang version string) is not the tested release."""
    if installed != TESTED_SGLANG_VERSION:
        warnings.warn(
            f"--radix-cache-backend tokencache is tested with sglang {TESTED_SGLANG_VERSION}; "
            f"the installed sglang is {installed}. SGLang's prefix-cache interface changes "
            f"between releases: install sglang=={TESTED_SGLANG_VERSION}, or run tests/sglang "
            "against this one before serving with it.",
            UntestedSGLangVersionWarning,
            stacklevel=3,
        )


def _server_arg(ctx: TreeCacheBuildContext, name: str, default: Any = None) -> Any:
    return getattr(ctx.server_args, name, default) if ctx.server_args is not None else default


def unsupported_reasons(ctx: TreeCacheBuildContext) -> list[str]:
    """Every configuration in ``ctx`` this backend cannot serve (empty when all is well)."""
    reasons = []
    if ctx.is_hybrid_ssm:
        reasons.append("models with mamba/SSM state (hybrid SSM)")
    if ctx.is_hybrid_swa:
        reasons.append("hybrid sliding-window-attention models (SWA)")
    if ctx.is_dsa:
        reasons.append("DeepSeek sparse attention (DSA) models")
    if ctx.enable_hierarchical_cache:
        reasons.append("--enable-hierarchical-cache (HiCache)")
    if _server_arg(ctx, "disaggregation_decode_retraction_backup") == "host_pool":
        reasons.append("--disaggregation-decode-retraction-backup host_pool")
    if _server_arg(ctx, "enable_streaming_session"):
        reasons.append("--enable-streaming-session")
    if _server_arg(ctx, "enable_session_radix_cache") or ctx.params.enable_session_radix_cache:
        reasons.append("--enable-session-radix-cache")
    if _server_arg(ctx, "enable_lmcache"):
        reasons.append("--enable-lmcache")
    if ctx.params.is_eagle:
        reasons.append("EAGLE speculative decoding (bigram radix keys)")
    policy = (ctx.params.eviction_policy or "lru").lower()
    if policy not in SUPPORTED_EVICTION_POLICIES:
        supported = ", ".join(SUPPORTED_EVICTION_POLICIES)
        reasons.append(f"--radix-eviction-policy {policy} (supported: {supported})")
    if ctx.params.eviction_policy_config:
        reasons.append("--radix-eviction-policy-config")
    return reasons


def build_tokencache(ctx: TreeCacheBuildContext) -> TokenCacheRadixCache:
    """The registry factory: a TokenCacheRadixCache, or a start-up error naming what to drop."""
    reasons = unsupported_reasons(ctx)
    if reasons:
        raise UnsupportedConfigError(
            "--radix-cache-backend tokencache does not support: "
            + "; ".join(reasons)
            + ". Drop those options, or drop --radix-cache-backend to use SGLang's own cache."
        )
    return TokenCacheRadixCache(ctx.params)


def register() -> None:
    """Entry point: idempotent, since several SGLang processes (and tests) load plugins."""
    existing = get_radix_cache_factory(BACKEND_NAME)
    if existing is build_tokencache:
        return
    if existing is not None:
        raise RuntimeError(
            f"radix-cache backend {BACKEND_NAME!r} is already registered by {existing!r}"
        )
    warn_if_untested(sglang_version())
    register_radix_cache_backend(BACKEND_NAME, build_tokencache)
