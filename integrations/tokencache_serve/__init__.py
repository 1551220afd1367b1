"""OpenAI-compatible HTTP serving of two-model token routing (`tokencache serve`).

Every request goes through a RoutedEngine's continuous batching (engine.submit); each response
says which tokens the large model wrote (the `tokencache` extension field of a choice).
"""

from .app import DEFAULT_MODEL_NAME, ServerConfig, create_app
from .errors import APIError

__all__ = ["DEFAULT_MODEL_NAME", "APIError", "ServerConfig", "create_app"]
