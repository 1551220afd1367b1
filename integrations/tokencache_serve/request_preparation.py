"""A generation request's body made ready for the engine: parsed, checked against the served
model and the limits, its prompt tokenized (a chat's through its template), and its max_tokens
fixed. Runs in the prompt pool, off the event loop; every refusal is an APIError naming the
field as the client sent it."""

from __future__ import annotations

from typing import Any

from .chat_template import render_chat
from .errors import APIError, bad_request
from .prefix_hits import PrefixHits
from .protocol import (
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    parse_chat,
    parse_completion,
    parse_json_body,
    shown,
)
from .server_config import ServerConfig


def check_model_name(name: str, served: str) -> None:
    if name != served:
        raise APIError(
            404,
            f"The model `{shown(name)}` does not exist. This server serves "
            f"`{served}` (GET /v1/models).",
            param="model",
            code="model_not_found",
        )


class RequestPreparer:
    def __init__(
        self,
        config: ServerConfig,
        tokenizer: Any,
        vocab_size: int,
        max_context: int,
        prefix_hits: PrefixHits,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.prefix_hits = prefix_hits

    def completion(self, raw: bytes) -> tuple[CompletionRequest, list[int], int]:
        """(request, prompt ids, max_tokens)."""
        req = parse_completion(parse_json_body(raw), self.config.default_temperature)
        check_model_name(req.params.model, self.config.model_name)
        default = self.config.completion_max_tokens
        if isinstance(req.prompt, list):  # the length limits first: before walking a long list
            self._max_tokens(req.params, len(req.prompt), default, "prompt")
        ids = self._encode(req.prompt, add_special_tokens=True)
        max_tokens = self._max_tokens(req.params, len(ids), default, "prompt")
        self.prefix_hits.count(ids)
        return req, ids, max_tokens

    def chat(self, raw: bytes) -> tuple[ChatRequest, list[int], int]:
        """(request, prompt ids, max_tokens)."""
        req = parse_chat(parse_json_body(raw), self.config.default_temperature)
        check_model_name(req.params.model, self.config.model_name)
        text = render_chat(self.tokenizer, req.messages)
        ids = self._encode(text, add_special_tokens=False)
        max_tokens = self._max_tokens(req.params, len(ids), self.config.chat_max_tokens, "messages")
        self.prefix_hits.count(ids)
        return req, ids, max_tokens

    def _encode(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            for i, t in enumerate(prompt):
                if not 0 <= t < self.vocab_size:
                    raise bad_request(
                        f"Invalid 'prompt': token id {shown(t)} at index {i} is outside the "
                        f"vocabulary [0, {self.vocab_size}).",
                        "prompt",
                        "invalid_value",
                    )
            return prompt
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise bad_request(
                "Invalid 'prompt': it encodes to no tokens.", "prompt", "empty_prompt"
            )
        return [int(t) for t in ids]

    def _check_prompt_len(self, prompt_len: int, prompt_param: str) -> None:
        cap = self.config.max_prompt_tokens  # beyond the context: the context's own message
        if cap is not None and cap < prompt_len < self.max_context:
            raise bad_request(
                f"This server takes at most {cap} prompt tokens "
                f"(--max-prompt-tokens); the prompt has {prompt_len}.",
                prompt_param,
                "context_length_exceeded",
            )

    def _max_tokens(
        self, params: GenerationParams, prompt_len: int, default: int, prompt_param: str
    ) -> int:
        self._check_prompt_len(prompt_len, prompt_param)
        limit = self.max_context
        asked = params.max_tokens
        name = params.max_tokens_param  # max_tokens, or the chat's max_completion_tokens
        cap = self.config.max_tokens_limit  # beyond the context: the context's own message
        if cap is not None and asked is not None and cap < asked and prompt_len + cap <= limit:
            raise bad_request(
                f"Invalid '{name}': this server generates at most {cap} "
                f"tokens per request (--max-tokens-limit), got {shown(asked)}.",
                name,
                "invalid_value",
            )
        if prompt_len >= limit or (asked is not None and prompt_len + asked > limit):
            what = "" if asked is None else f" and {shown(asked)} tokens to generate"
            raise bad_request(
                f"This model's maximum context length is {limit} tokens (KV pool and positions). "
                f"However, you requested {prompt_len} prompt tokens{what}. Shorten the prompt "
                f"or {name}.",
                prompt_param if prompt_len >= limit or asked is None else name,
                "context_length_exceeded",
            )
        if asked is not None:
            return asked
        return min(default, limit - prompt_len, cap or default)
