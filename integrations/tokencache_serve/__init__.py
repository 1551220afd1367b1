"""OpenAI-compatible HTTP serving of two-model token routing (`tokencache serve`).

Every request goes through a RoutedEngine's continuous batching (engine.submit); each response
says which tokens the large model wrote (the `tokencache` extension field of a choice).

The names below are imported on first use (PEP 562), so that `tokencache serve --help` starts
without starlette or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokencache_extras import lazy_attributes

if TYPE_CHECKING:
    from .app import create_app
    from .errors import APIError
    from .server_config import ServerConfig

DEFAULT_MODEL_NAME = "tokencache-routed"
_HOMES = {"ServerConfig": ".server_config", "create_app": ".app", "APIError": ".errors"}

__all__ = ["DEFAULT_MODEL_NAME", "APIError", "ServerConfig", "create_app"]


__getattr__ = lazy_attributes(__name__, _HOMES, globals())
