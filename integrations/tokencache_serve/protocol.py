"""Parsing and validation of OpenAI completion / chat-completion request bodies.

Every refusal is an APIError (400 unless said otherwise) naming the offending field, raised
before anything reaches the engine. Unknown fields are refused as OpenAI does; known fields this
server does not implement are refused only when set to something other than their no-op value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import APIError, bad_request

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop string: the stream's hold-back check is quadratic in it
GREEDY_BELOW = 1e-5  # a lower temperature is greedy (its limit; as vLLM and the engine)
SEED_LIMIT = 2**63  # seeds in [0, 2**63): what torch.Generator.manual_seed takes as given
_SHOWN = 64  # characters of a client's value quoted back in an error message


@dataclass(frozen=True)
class GenerationParams:
    """What both endpoints share; max_tokens None = the endpoint's default."""

    model: str
    max_tokens: int | None
    stop: tuple[str, ...]
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool
    # The field max_tokens came in ("max_tokens", or a chat's "max_completion_tokens"): a
    # refusal of its value names that field, as the client wrote it.
    max_tokens_param: str = "max_tokens"


@dataclass(frozen=True)
class CompletionRequest:
    params: GenerationParams
    prompt: str | list[int]  # text, or token ids


@dataclass(frozen=True)
class ChatRequest:
    params: GenerationParams
    messages: list[dict[str, str]]


# Fields accepted and ignored: they change nothing in what is generated.
_IGNORED = ("user", "metadata", "store")
_COMMON = (
    "model",
    "max_tokens",
    "stop",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    *_IGNORED,
)
COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "echo", "suffix", "best_of"))
CHAT_FIELDS = frozenset(
    (
        *_COMMON,
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
    )
)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose every string is valid Unicode, or a 400 saying why not.

    Python's json accepts what OpenAI's parser refuses (lone surrogates from "\\ud800"
    escapes) or cannot represent (nesting deeper than the recursion limit, integers of more
    than 4300 digits); each is refused here, so nothing later meets it.
    """
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _invalid_json(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise _invalid_json("the body is not valid UTF-8") from None
    except RecursionError:
        raise _invalid_json("arrays or objects are nested too deeply") from None
    except ValueError:  # int() refuses more than sys.get_int_max_str_digits() digits
        raise _invalid_json("a number has too many digits") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"The request body must be a JSON object, not {_json_type(body)}.", code="invalid_json"
        )
    _check_unicode(body)
    return body


def _invalid_json(why: str) -> APIError:
    return bad_request(
        f"We could not parse the JSON body of your request: {why}. The request body must be a "
        "JSON object.",
        code="invalid_json",
    )


def shown(v: object) -> str:
    """A client's value for an error message: printable, escaped, at most _SHOWN characters."""
    text = v if isinstance(v, str) else repr(v)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _valid_unicode(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: "\ud800" is valid JSON, not valid text
        return False
    return True


def _check_unicode(body: dict[str, Any]) -> None:
    """Every key and string in the body encodes as UTF-8; else a 400 naming where (iterative:
    the parser already bounded the depth)."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        obj, where = stack.pop()
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            if isinstance(k, str):
                if not _valid_unicode(k):
                    raise bad_request(
                        f"Invalid field name {shown(k)!r}{' in ' + where if where else ''}: "
                        "it contains a lone surrogate (not valid Unicode).",
                        shown(f"{where}.{k}" if where else k),
                        "invalid_value",
                    )
                path = f"{where}.{k}" if where else k
            else:
                path = f"{where}[{k}]"
            if isinstance(v, str):
                if not _valid_unicode(v):
                    raise bad_request(
                        f"Invalid '{shown(path)}': the string contains a lone surrogate (not "
                        "valid Unicode).",
                        shown(path),
                        "invalid_value",
                    )
            elif isinstance(v, (dict, list)):
                stack.append((v, path))


def parse_completion(
    body: Mapping[str, Any], default_temperature: float = 1.0
) -> CompletionRequest:
    _check_fields(body, COMPLETION_FIELDS)
    _unsupported_if(body, "echo", lambda v: v is not None and v is not False, "echo")
    _unsupported_if(body, "suffix", lambda v: v is not None and v != "", "suffix")
    _unsupported_if(body, "best_of", lambda v: v is not None and v != 1, "best_of > 1")
    _unsupported_if(body, "logprobs", lambda v: v is not None, "logprobs")
    params = _common(body, "max_tokens", default_temperature)
    if "prompt" not in body:
        raise bad_request("Missing required parameter: 'prompt'.", "prompt", "missing_required")
    return CompletionRequest(params, _prompt(body["prompt"]))


def parse_chat(body: Mapping[str, Any], default_temperature: float = 1.0) -> ChatRequest:
    _check_fields(body, CHAT_FIELDS)
    _unsupported_if(body, "logprobs", lambda v: v is not None and v is not False, "logprobs")
    _unsupported_if(body, "top_logprobs", lambda v: v is not None, "top_logprobs")
    for name in ("tools", "functions"):
        _unsupported_if(body, name, lambda v: v is not None and v != [], f"{name} (tool calls)")
    for name in ("tool_choice", "function_call"):
        _unsupported_if(body, name, lambda v: v is not None and v != "none", f"{name}")
    _unsupported_if(
        body,
        "response_format",
        lambda v: v is not None and v != {"type": "text"},
        "response_format other than {'type': 'text'}",
    )
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad_request(
            "Give max_tokens or max_completion_tokens, not both.",
            "max_completion_tokens",
            "invalid_value",
        )
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _common(body, key, default_temperature)
    if "messages" not in body:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing_required")
    return ChatRequest(params, _messages(body["messages"]))


# ------------------------------------------------------------------------------------ helpers


def _json_type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _type_error(name: str, expected: str, got: object) -> APIError:
    return bad_request(
        f"Invalid type for '{name}': expected {expected}, but got {_json_type(got)} instead.",
        name,
        "invalid_type",
    )


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for key in body:
        if key not in allowed:
            raise bad_request(
                f"Unrecognized request argument supplied: {shown(key)}",
                shown(key),
                "unrecognized_argument",
            )


def _unsupported_if(
    body: Mapping[str, Any], name: str, is_set: Callable[[Any], bool], what: str
) -> None:
    if name in body and is_set(body[name]):
        raise bad_request(
            f"Unsupported parameter: {what} is not supported by this server.",
            name,
            "unsupported_parameter",
        )


def _int(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise _type_error(name, "an integer", v)
    return v


def _number(body: Mapping[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    try:
        f = float(v)
    except OverflowError:  # an integer beyond the float range
        f = math.inf
    if not math.isfinite(f):
        raise bad_request(f"Invalid '{name}': must be a finite number.", name, "invalid_value")
    return f


def _bool(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _common(body: Mapping[str, Any], max_key: str, default_temperature: float) -> GenerationParams:
    model = body.get("model")
    if model is None:
        raise bad_request("Missing required parameter: 'model'.", "model", "missing_required")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)

    n = _int(body, "n")
    if n is not None and n != 1:
        if n < 1:
            raise bad_request(f"Invalid 'n': must be >= 1, got {shown(n)}.", "n", "invalid_value")
        raise bad_request(
            f"Unsupported parameter: n = {shown(n)}; this server returns one choice per request "
            "(n = 1). Send several requests instead.",
            "n",
            "unsupported_parameter",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name)
        if v is not None and v != 0.0:
            raise bad_request(
                f"Unsupported parameter: {name} is not supported by this server (only 0).",
                name,
                "unsupported_parameter",
            )
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _type_error("logit_bias", "an object", bias)
    if bias:
        raise bad_request(
            "Unsupported parameter: logit_bias is not supported by this server.",
            "logit_bias",
            "unsupported_parameter",
        )
    for name in ("user",):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _type_error(name, "a string", body[name])

    max_tokens = _int(body, max_key)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(
            f"Invalid '{max_key}': integer below minimum value. Expected a value >= 1, but got "
            f"{shown(max_tokens)} instead.",
            max_key,
            "integer_below_min_value",
        )

    temperature = _number(body, "temperature")
    if temperature is None:
        temperature = default_temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(
            f"Invalid 'temperature': must be between 0 and 2, got {temperature}.",
            "temperature",
            "invalid_value",
        )
    top_p = _number(body, "top_p")
    if top_p is None:
        top_p = 1.0
    if not 0.0 < top_p <= 1.0:
        raise bad_request(
            f"Invalid 'top_p': must be in (0, 1], got {top_p}.", "top_p", "invalid_value"
        )
    seed = _int(body, "seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise bad_request(
            f"Invalid 'seed': must be an integer in [0, 2**63), got {shown(seed)}.",
            "seed",
            "invalid_value",
        )

    stream = _bool(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _type_error("stream_options", "an object", opts)
        if not stream:
            raise bad_request(
                "Invalid 'stream_options': only allowed when 'stream' is true.",
                "stream_options",
                "invalid_value",
            )
        for key in opts:
            if key != "include_usage":
                raise bad_request(
                    f"Unrecognized stream option: {shown(key)}",
                    "stream_options",
                    "unrecognized_argument",
                )
        include_usage = _bool(opts, "include_usage")

    return GenerationParams(
        model=model,
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stream=stream,
        include_usage=include_usage,
        max_tokens_param=max_key,
    )


def _stop(v: object) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or an array of strings", v)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(
            f"Invalid 'stop': at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}.",
            "stop",
            "invalid_value",
        )
    if any(s == "" for s in stops):
        raise bad_request(
            "Invalid 'stop': stop sequences must be non-empty.", "stop", "invalid_value"
        )
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(
            f"Invalid 'stop': a stop sequence may have at most {MAX_STOP_CHARS} characters.",
            "stop",
            "invalid_value",
        )
    return tuple(stops)


def _prompt(v: object) -> str | list[int]:
    """A string, an array of token ids, or either wrapped in a one-element array."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if v == "":
            raise bad_request("Invalid 'prompt': the prompt is empty.", "prompt", "empty_prompt")
        return v
    if isinstance(v, list):
        if not v:
            raise bad_request("Invalid 'prompt': the prompt is empty.", "prompt", "empty_prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return list(v)
        if all(isinstance(t, (str, list)) for t in v):
            raise bad_request(
                f"Unsupported parameter: a batch of {len(v)} prompts; this server takes one "
                "prompt per request.",
                "prompt",
                "unsupported_parameter",
            )
    raise _type_error("prompt", "a string or an array of token ids", v)


def _messages(v: object) -> list[dict[str, str]]:
    if not isinstance(v, list):
        raise _type_error("messages", "an array", v)
    if not v:
        raise bad_request(
            "Invalid 'messages': empty array. Expected an array with at least 1 message.",
            "messages",
            "empty_array",
        )
    out: list[dict[str, str]] = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{where}.role", "a string", role)
        if role not in CHAT_ROLES:
            raise bad_request(
                f"Invalid value for '{where}.role': {shown(role)!r}; supported roles are "
                f"{', '.join(CHAT_ROLES)}.",
                f"{where}.role",
                "invalid_value",
            )
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(v: object, where: str) -> str:
    """Message content: a string, null, or an array of text parts (joined)."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict):
                raise _type_error(f"{where}[{j}]", "an object", part)
            if part.get("type") != "text":
                raise bad_request(
                    f"Unsupported content part type {shown(part.get('type'))!r} in "
                    f"'{where}[{j}]': "
                    "this server takes text only.",
                    f"{where}[{j}].type",
                    "unsupported_parameter",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _type_error(f"{where}[{j}].text", "a string", text)
            texts.append(text)
        return "".join(texts)
    raise _type_error(where, "a string or an array of content parts", v)
