"""Shared set-up: import sglang (tokencache_sglang.sglang_import) and tokencache once per run.

A missing sglang or tokencache fails every test here (never skips): this folder exists to
check the SGLang backend.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_INTEGRATIONS = Path(__file__).resolve().parents[2] / "integrations"
if str(_INTEGRATIONS) not in sys.path:
    # Lets the tests run from a checkout without `pip install -e integrations`.
    sys.path.insert(0, str(_INTEGRATIONS))

_IMPORT_ERROR: str | None = None
try:
    from tokencache_sglang.sglang_import import import_sglang

    import_sglang()  # the project's one way in: stubs torchvision first on CPU-only hosts
    from sglang.srt.mem_cache import common, registry  # noqa: F401

    import tokencache  # noqa: F401
except Exception as exc:  # any import failure must surface as a test failure
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="session")
def sgl() -> SimpleNamespace:
    """The sglang and tokencache names the tests use, imported once."""
    if _IMPORT_ERROR is not None:
        pytest.fail(
            "tests/sglang need sglang==0.5.23 and the tokencache extension importable "
            f"(see requirements/sglang*.txt): {_IMPORT_ERROR}",
            pytrace=False,
        )
    import torch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, release_req
    from sglang.srt.mem_cache import common, registry
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from tokencache_sglang import cache, plugin

    return SimpleNamespace(
        torch=torch,
        Req=Req,
        FINISH_ABORT=FINISH_ABORT,
        FINISH_LENGTH=FINISH_LENGTH,
        release_req=release_req,
        common=common,
        registry=registry,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        EvictParams=EvictParams,
        InsertParams=InsertParams,
        MatchPrefixParams=MatchPrefixParams,
        CacheInitParams=CacheInitParams,
        ReqToTokenPool=ReqToTokenPool,
        RadixCache=RadixCache,
        RadixKey=RadixKey,
        SamplingParams=SamplingParams,
        cache=cache,
        plugin=plugin,
    )


@pytest.fixture(scope="session")
def runtime(sgl: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """SGLang's process-wide config, published as a scheduler would, with our backend selected.

    SGLang's helpers read it (release_kv_cache, create_tree_cache). The model is a tiny local
    Llama config, so nothing is downloaded.
    """
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(model_dir)
    sgl.plugin.register()  # --radix-cache-backend only accepts registered names
    server_args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        skip_tokenizer_init=True,
        radix_cache_backend="tokencache",
    )
    runtime_context.publish(server_args, role="test")
    return SimpleNamespace(server_args=server_args, context=runtime_context)
