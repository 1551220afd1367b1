"""Optional dependencies of the integrations, and the one-line message naming their extra.

The integrations package installs with ``tokencache`` and numpy only; each feature's packages
come with an extra of ``integrations/pyproject.toml`` (``models``, ``routing``, ``sglang``,
``bench``, ``serve``). Import an optional package through :func:`require` (library code: raises
:class:`MissingExtra`, an ImportError) or :func:`require_or_exit` (CLIs, after argparse, so that
``--help`` works without it: exits with that one line instead of a traceback).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

EXTRAS = ("models", "routing", "sglang", "bench", "serve", "gateway")


class MissingExtra(ImportError):
    """An optional package does not import; the message names the extra that installs it."""


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra`` (run at the repository root)."""
    return f'pip install "./integrations[{extra}]"'


def require(module: str, *, extra: str) -> ModuleType:
    """``import module``, or MissingExtra naming ``extra`` when it is missing or cannot load
    (e.g. a torch wheel whose CUDA libraries are absent)."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as exc:
        top = module.split(".")[0]
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MissingExtra(
            f"{top} is needed here and does not import ({reason}); it comes with the "
            f"{extra!r} extra: {install_hint(extra)}",
            name=top,
        ) from exc


def require_or_exit(*modules: str, extra: str, prog: str) -> None:
    """For a CLI's main, after argparse: exit 1 with one line when any of ``modules`` is
    missing."""
    for module in modules:
        try:
            require(module, extra=extra)
        except MissingExtra as exc:
            raise SystemExit(f"{prog}: {exc}") from None


def lazy_attributes(
    package: str, homes: dict[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that imports ``name`` from its home submodule on first
    use and caches it in ``namespace``, so a package's ``import`` pulls in no heavy dependency
    (its commands' ``--help`` then works without torch)."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    return __getattr__
