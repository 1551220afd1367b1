"""Request validation on its own (protocol.py, no server): each refusal's exact message, param
and code as a client sees them (OpenAI's wording where OpenAI has one), and the defaults."""

from __future__ import annotations

from typing import Any

import pytest

from tokencache_serve.errors import APIError
from tokencache_serve.protocol import parse_chat, parse_completion, parse_json_body

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **kw}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **kw}


CHAT_REFUSALS = [
    # (body, param, code, message)
    (
        {"model": "m"},
        "messages",
        "missing_required",
        "Missing required parameter: 'messages'.",
    ),
    (
        chat(logprobs=True),
        "logprobs",
        "unsupported_parameter",
        "Unsupported parameter: logprobs is not supported by this server.",
    ),
    (
        chat(messages=[1]),
        "messages[0]",
        "invalid_type",
        "Invalid type for 'messages[0]': expected an object, but got an integer instead.",
    ),
    (
        chat(messages=[{"role": 1.5, "content": "x"}]),
        "messages[0].role",
        "invalid_type",
        "Invalid type for 'messages[0].role': expected a string, but got a number instead.",
    ),
    (
        chat(messages=[{"role": "user", "content": ["x"]}]),
        "messages[0].content[0]",
        "invalid_type",
        "Invalid type for 'messages[0].content[0]': expected an object, but got a string instead.",
    ),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "messages[0].content[0].type",
        "unsupported_parameter",
        "Unsupported content part type 'image_url' in 'messages[0].content[0]': this server "
        "takes text only.",
    ),
    (
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
        "messages[0].content[0].text",
        "invalid_type",
        "Invalid type for 'messages[0].content[0].text': expected a string, but got an "
        "integer instead.",
    ),
    (
        chat(messages=[{"role": "user", "content": {"text": "x"}}]),
        "messages[0].content",
        "invalid_type",
        "Invalid type for 'messages[0].content': expected a string or an array of content "
        "parts, but got an object instead.",
    ),
]

COMPLETION_REFUSALS = [
    (
        completion(model=5),
        "model",
        "invalid_type",
        "Invalid type for 'model': expected a string, but got an integer instead.",
    ),
    (completion(n=0), "n", "invalid_value", "Invalid 'n': must be >= 1, got 0."),
    (
        completion(logit_bias=[1]),
        "logit_bias",
        "invalid_type",
        "Invalid type for 'logit_bias': expected an object, but got an array instead.",
    ),
    (
        completion(max_tokens=0),
        "max_tokens",
        "integer_below_min_value",
        "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 "
        "instead.",
    ),
    (
        completion(stream=True, stream_options=1),
        "stream_options",
        "invalid_type",
        "Invalid type for 'stream_options': expected an object, but got an integer instead.",
    ),
    (
        completion(stream_options={"include_usage": True}),
        "stream_options",
        "invalid_value",
        "Invalid 'stream_options': only allowed when 'stream' is true.",
    ),
    (
        completion(stream=True, stream_options={"include_usage": True, "x": 1}),
        "stream_options",
        "unrecognized_argument",
        "Unrecognized stream option: x",
    ),
    (
        completion(best_of=2),
        "best_of",
        "unsupported_parameter",
        "Unsupported parameter: best_of > 1 is not supported by this server.",
    ),
    (
        completion(temperature="hot"),
        "temperature",
        "invalid_type",
        "Invalid type for 'temperature': expected a number, but got a string instead.",
    ),
    (
        completion(prompt=""),
        "prompt",
        "empty_prompt",
        "Invalid 'prompt': the prompt is empty.",
    ),
    (
        completion(prompt=["a", "b"]),
        "prompt",
        "unsupported_parameter",
        "Unsupported parameter: a batch of 2 prompts; this server takes one prompt per request.",
    ),
]


@pytest.mark.parametrize(
    "parse,body,param,code,message",
    [(parse_chat, *case) for case in CHAT_REFUSALS]
    + [(parse_completion, *case) for case in COMPLETION_REFUSALS],
)
def test_refusals_name_the_field_in_the_clients_words(
    parse: Any, body: dict[str, Any], param: str, code: str, message: str
) -> None:
    with pytest.raises(APIError) as e:
        parse(body)
    err = e.value
    assert (err.status, err.type, err.param, err.code) == (
        400,
        "invalid_request_error",
        param,
        code,
    )
    assert err.message == message


def test_defaults_are_openais() -> None:
    for parse, body in ((parse_chat, chat()), (parse_completion, completion())):
        p = parse(body).params
        assert (p.temperature, p.top_p, p.seed, p.stop, p.max_tokens) == (1.0, 1.0, None, (), None)
        assert (p.stream, p.include_usage) == (False, False)


def test_bodies_python_accepts_but_openai_refuses_are_named() -> None:
    def refusal(raw: bytes) -> APIError:
        with pytest.raises(APIError) as e:
            parse_json_body(raw)
        assert e.value.status == 400
        return e.value

    e = refusal(b'{"a": ' + b"1" * 5000 + b"}")
    assert (e.param, e.code) == (None, "invalid_json")
    assert e.message == (
        "We could not parse the JSON body of your request: a number has too many digits. The "
        "request body must be a JSON object."
    )
    e = refusal(b'{"model": "\\ud800"}')
    assert (e.param, e.code) == ("model", "invalid_value")
    assert e.message == (
        "Invalid 'model': the string contains a lone surrogate (not valid Unicode)."
    )
    e = refusal(b'{"m": {"k": ["ok", "\\udc00"]}}')
    assert e.param == "m.k[1]" and e.message.startswith("Invalid 'm.k[1]': the string")
    e = refusal(b'{"\\ud800x": 1}')  # in a field name
    assert e.code == "invalid_value" and e.message.startswith("Invalid field name ")
    assert e.message.endswith(": it contains a lone surrogate (not valid Unicode).")
