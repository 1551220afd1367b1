"""What one server serves and the limits it applies to each request (ServerConfig); cli.py sets
it from `tokencache serve`'s flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from .kv_events import KVEventsConfig

MAX_BODY_BYTES = 8 * 2**20
BODY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = DEFAULT_MODEL_NAME
    completion_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    chat_max_tokens: int = 256  # /v1/chat/completions without max_tokens (capped by the context)
    default_temperature: float = 1.0  # OpenAI's default; 0 = greedy
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies: 413, before they are read
    body_timeout_s: float = BODY_TIMEOUT_S  # the whole body must arrive within this: else 408
    max_prompt_tokens: int | None = None  # None: what the context allows
    max_tokens_limit: int | None = None  # the largest max_tokens accepted; None: the context's
    api_key: str | None = None  # checked on every /v1 route (Authorization: Bearer KEY)
    allowed_origins: tuple[str, ...] = ()  # CORS; none by default (no CORS headers at all)
    allowed_hosts: tuple[str, ...] | None = None  # Host header values served; None: any
    tokenizer_threads: int = 2  # per pool: one for prompts, one for outputs
    system_fingerprint: str | None = None  # None: from the model name and tokencache's version
    # Publish the small model's KV events as an SGLang worker does (kv_events.py); /server_info
    # describes the publisher. None: no events.
    kv_events: KVEventsConfig | None = None
    max_running: int | None = None  # reported by /server_info and /v1/loads

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
