"""OpenAI-compatible HTTP serving of two-model token routing (`tokencache serve`).

Every request goes through a RoutedEngine's continuous batching (engine.submit); each response
says which tokens the large model wrote (the `tokencache` extension field of a choice).

The names below are imported on first use (PEP 562), so that `tokencache serve --help` starts
without starlette or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import ServerConfig, create_app
    from .errors import APIError

DEFAULT_MODEL_NAME = "tokencache-routed"
_HOMES = {"ServerConfig": ".app", "create_app": ".app", "APIError": ".errors"}

__all__ = ["DEFAULT_MODEL_NAME", "APIError", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
