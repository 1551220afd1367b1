"""SGLang's plugin loader and radix-cache registry build the backend."""

from __future__ import annotations

import importlib
import sys
import warnings
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "integrations" / "pyproject.toml"


def declared_entry_point() -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return project["entry-points"]["sglang.srt.plugins"]["tokencache"]


@pytest.fixture
def installed_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """What `pip install integrations/` puts on sys.path: a dist-info with the entry point."""
    dist_info = tmp_path / "tokencache_integrations-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tokencache-integrations\nVersion: 0.1.0\n"
    )
    value = declared_entry_point()
    (dist_info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\ntokencache = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return value


def build_context(sgl: SimpleNamespace, runtime: SimpleNamespace, **overrides: Any) -> Any:
    params = sgl.CacheInitParams(
        disable=overrides.pop("disable", False),
        req_to_token_pool=sgl.ReqToTokenPool(
            size=4, max_context_len=256, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=sgl.PagedTokenToKVPoolAllocator(
            size=256,
            page_size=16,
            dtype=sgl.torch.float16,
            device="cpu",
            kvcache=None,
            need_sort=False,
        ),
        page_size=16,
        eviction_policy=overrides.pop("eviction_policy", "lru"),
        is_eagle=overrides.pop("is_eagle", False),
    )
    fields = dict(
        server_args=runtime.server_args,
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=params.disable,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    fields.update(overrides)
    return sgl.registry.TreeCacheBuildContext(**fields)


def test_entry_point_loads_through_sglang(sgl: SimpleNamespace, installed_entry_point: str) -> None:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    assert installed_entry_point == "tokencache_sglang.plugin:register"
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    func, dist = plugins["tokencache"]
    assert dist == "tokencache-integrations"
    func()
    func()  # every SGLang process loads plugins; registering twice must be harmless
    assert sgl.registry.get_radix_cache_factory("tokencache") is sgl.plugin.build_tokencache
    assert "tokencache" in sgl.registry.registered_radix_cache_backends()


def test_the_tested_sglang_is_the_one_the_extra_pins(sgl: SimpleNamespace) -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang=={sgl.plugin.TESTED_SGLANG_VERSION}"]


@pytest.fixture
def registrations(sgl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """What register() hands SGLang's registry, which is left as it is."""
    calls: list[tuple] = []
    monkeypatch.setattr(sgl.plugin, "get_radix_cache_factory", lambda name: None)
    monkeypatch.setattr(
        sgl.plugin, "register_radix_cache_backend", lambda *args: calls.append(args)
    )
    return calls


@pytest.mark.parametrize("installed", ["0.5.22", "0.5.24", "0.6.0", "unknown"])
def test_register_warns_when_sglang_is_not_the_tested_release(
    sgl: SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    registrations: list[tuple],
    installed: str,
) -> None:
    monkeypatch.setattr(sgl.plugin, "sglang_version", lambda: installed)
    with pytest.warns(sgl.plugin.UntestedSGLangVersionWarning) as caught:
        sgl.plugin.register()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"tested with sglang {sgl.plugin.TESTED_SGLANG_VERSION}" in message
    assert f"the installed sglang is {installed}." in message
    assert registrations == [("tokencache", sgl.plugin.build_tokencache)]  # it still serves


def test_register_is_quiet_on_the_tested_release(
    sgl: SimpleNamespace, registrations: list[tuple]
) -> None:
    assert sgl.plugin.sglang_version() == sgl.plugin.TESTED_SGLANG_VERSION
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgl.plugin.register()
    assert registrations == [("tokencache", sgl.plugin.build_tokencache)]


def test_create_tree_cache_selects_tokencache(
    sgl: SimpleNamespace, runtime: SimpleNamespace
) -> None:
    assert runtime.context.get_memory().radix_cache_backend == "tokencache"
    cache = sgl.registry.create_tree_cache(build_context(sgl, runtime))
    assert isinstance(cache, sgl.cache.TokenCacheRadixCache)
    assert cache.page_size == 16 and cache.supports_prefix_sharing()
    # It serves the scheduler straight away: insert, match, sizes.
    tokens = sgl.torch.arange(40)
    key = sgl.RadixKey(array("q", tokens.tolist()))
    value = sgl.torch.arange(16, 56, dtype=sgl.torch.int64)
    assert cache.insert(sgl.InsertParams(key=key, value=value)).prefix_len == 0
    match = cache.match_prefix(sgl.MatchPrefixParams(key=key))
    assert match.device_prefix_len == 32
    assert cache.path_device_indices(match.last_device_node).tolist() == list(range(16, 48))
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (32, 0, 32)


def test_disabled_radix_cache(sgl: SimpleNamespace, runtime: SimpleNamespace) -> None:
    cache = sgl.registry.create_tree_cache(build_context(sgl, runtime, disable=True))
    assert cache.disable and not cache.supports_prefix_sharing()
    key = sgl.RadixKey(array("q", range(32)))
    value = sgl.torch.arange(32, dtype=sgl.torch.int64)
    assert cache.insert(sgl.InsertParams(key=key, value=value)).prefix_len == 0
    assert cache.match_prefix(sgl.MatchPrefixParams(key=key)).device_prefix_len == 0
    assert cache.total_size() == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"is_hybrid_ssm": True}, "mamba"),
        ({"is_hybrid_swa": True}, "SWA"),
        ({"enable_hierarchical_cache": True}, "HiCache"),
        ({"is_dsa": True}, "DSA"),
        ({"is_eagle": True}, "EAGLE"),
        ({"eviction_policy": "slru"}, "slru"),
        ({"eviction_policy": "priority"}, "priority"),
        ({"eviction_policy": "mru"}, "mru"),
    ],
)
def test_unsupported_configs_fail_at_start_up(
    sgl: SimpleNamespace, runtime: SimpleNamespace, override: dict, message: str
) -> None:
    ctx = build_context(sgl, runtime, **override)
    with pytest.raises(sgl.cache.UnsupportedConfigError, match=message):
        sgl.registry.create_tree_cache(ctx)


def test_streaming_session_rejected(sgl: SimpleNamespace, runtime: SimpleNamespace) -> None:
    server_args = SimpleNamespace(enable_streaming_session=True)
    ctx = build_context(sgl, runtime, server_args=server_args)
    with pytest.raises(sgl.cache.UnsupportedConfigError, match="streaming-session"):
        sgl.plugin.build_tokencache(ctx)


def test_torchvision_is_stubbed_or_real(sgl: SimpleNamespace) -> None:
    import torchvision

    from tokencache_sglang import stubs

    stubbed = getattr(torchvision, "__tokencache_stub__", False)
    assert stubbed == ("torchvision" in stubs.installed())
    assert stubbed or torchvision.__version__ != "0.0.0"


def test_inert_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokencache_sglang import stubs

    finder = stubs._InertFinder(["tc_absent_pkg"])
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in [m for m in sys.modules if m.startswith("tc_absent_pkg")]:
        monkeypatch.delitem(sys.modules, name)
    transforms = importlib.import_module("tc_absent_pkg.transforms")

    assert sys.modules["tc_absent_pkg"].__version__ == "0.0.0"

    class Custom(transforms.Compose):  # subclassing a stubbed class must work
        pass

    assert isinstance(Custom(), Custom)
    assert not transforms.Normalize(mean=[0.5], std=[0.5])
    assert list(transforms.Resize(8)) == []
    assert not hasattr(transforms, "__wrapped__")  # dunders stay absent for introspection
    for name in [m for m in sys.modules if m.startswith("tc_absent_pkg")]:
        del sys.modules[name]
