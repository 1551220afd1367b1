"""Refusals the protocol tests left loose: each field's own type word and the penalty that
is refused by name (exact param, code and message, as a client reads them)."""

from __future__ import annotations

from typing import Any

import pytest

from tokencache_serve.errors import APIError
from tokencache_serve.protocol import parse_chat, parse_completion


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **kw}


@pytest.mark.parametrize(
    "body,param,message",
    [
        (
            completion(max_tokens="5"),
            "max_tokens",
            "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
        ),
        (
            completion(seed=[1]),
            "seed",
            "Invalid type for 'seed': expected an integer, but got an array instead.",
        ),
        (
            completion(stream="yes"),
            "stream",
            "Invalid type for 'stream': expected a boolean, but got a string instead.",
        ),
        (
            completion(stream=True, stream_options={"include_usage": 1}),
            "include_usage",
            "Invalid type for 'include_usage': expected a boolean, but got an integer instead.",
        ),
    ],
)
def test_a_wrong_type_names_what_was_expected_and_what_came(
    body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_type")
    assert e.value.message == message


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_each_penalty_other_than_zero_is_refused_by_name(name: str, parse: Any) -> None:
    body = completion(**{name: 0.5}) | {"messages": [{"role": "user", "content": "hi"}]}
    if parse is parse_completion:
        body.pop("messages")
    else:
        body.pop("prompt")
    with pytest.raises(APIError) as e:
        parse(body)
    assert (e.value.param, e.value.code) == (name, "unsupported_parameter")
    assert e.value.message == (
        f"Unsupported parameter: {name} is not supported by this server (only 0)."
    )
    parse(body | {name: 0})  # zero is the no-op value: accepted
