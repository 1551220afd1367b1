"""Import-time stand-ins for packages SGLang imports but a CPU-only host cannot load.

sglang 0.5.23 imports ``torchvision`` unconditionally (multimodal configs), and the PyPI
torchvision wheel links libtorch_cuda. Nothing on the radix-cache path calls into it, so an
inert module is enough. Call :func:`install` before the first ``import sglang``; on a GPU host
with a real torchvision installed, nothing is stubbed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

DEFAULT_MODULES: tuple[str, ...] = ("torchvision",)


class _Inert:
    """Any attribute, call, index or subclassing of it yields another inert value."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __call__(self, *_args: Any, **_kwargs: Any) -> _Inert:
        return _Inert()

    def __getattr__(self, name: str) -> _Inert:
        # Dunder lookups must fail, or copy/pickle/inspect probing goes astray.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __getitem__(self, _key: Any) -> _Inert:
        return _Inert()

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __mro_entries__(self, _bases: tuple[Any, ...]) -> tuple[type, ...]:
        # `class Foo(torchvision.X)` must still create a class.
        return (object,)


class _InertModule(types.ModuleType):
    __version__: str
    __tokencache_stub__: bool

    def __getattr__(self, name: str) -> _Inert:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Inert()


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an inert package for each stubbed top-level name and all of its submodules."""

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)

    def covers(self, fullname: str) -> bool:
        return any(fullname == r or fullname.startswith(r + ".") for r in self.roots)

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not self.covers(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _InertModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        module.__tokencache_stub__ = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _loadable(name: str) -> bool:
    """True when the real package imports (torchvision on a CUDA host); a wheel that is
    present but cannot load (CUDA build on a CPU torch) counts as absent."""
    if name in sys.modules:
        return not getattr(sys.modules[name], "__tokencache_stub__", False)
    try:
        if importlib.util.find_spec(name) is None:
            return False
        importlib.import_module(name)
        return True
    except Exception:
        # Drop the half-imported package so the stub can take its place.
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]
        return False


def install(modules: Sequence[str] = DEFAULT_MODULES, *, force: bool = False) -> list[str]:
    """Stub each of ``modules`` that is not really installed (all of them with ``force``).

    Returns the names now served by the stub. Idempotent. Must run before ``import sglang``.
    """
    for finder in sys.meta_path:
        if isinstance(finder, _InertFinder):
            return list(finder.roots)
    roots = [m for m in modules if force or not _loadable(m)]
    if roots:
        sys.meta_path.insert(0, _InertFinder(roots))
    return roots


def installed() -> list[str]:
    """Names currently served by the stub (empty when none)."""
    for finder in sys.meta_path:
        if isinstance(finder, _InertFinder):
            return list(finder.roots)
    return []
