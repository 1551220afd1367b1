"""Every bad request gets OpenAI's JSON error object with the right status, reaches nothing in
the engine, and the server keeps serving (same tokens as before, engine idle)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from serve_helpers import MODEL, Served, post_json, post_raw, serve

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def served(tiny: Any) -> Iterator[Served]:
    with serve(tiny, num_slots=256) as s:  # a small pool: max context 257 (< 2048 positions)
        yield s


def good(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": OK_PROMPT, "max_tokens": 4, "temperature": 0, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "t1 t2"}]
    return {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0, **kw}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (path, body, status, error code, param)
CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    # malformed bodies
    (C, b"{not json", 400, "invalid_json", None),
    (C, b"", 400, "invalid_json", None),
    (C, b"[1, 2]", 400, "invalid_json", None),
    (CHAT, b'{"model": "x", "messages": [', 400, "invalid_json", None),
    # fields of the wrong type
    (C, good(max_tokens="ten"), 400, "invalid_type", "max_tokens"),
    (C, good(max_tokens=True), 400, "invalid_type", "max_tokens"),
    (C, good(temperature="hot"), 400, "invalid_type", "temperature"),
    (C, good(top_p=[1]), 400, "invalid_type", "top_p"),
    (C, good(seed="s"), 400, "invalid_type", "seed"),
    (C, good(stream="yes"), 400, "invalid_type", "stream"),
    (C, good(stop=5), 400, "invalid_type", "stop"),
    (C, good(prompt=5), 400, "invalid_type", "prompt"),
    (C, good(prompt=[1, "a"]), 400, "invalid_type", "prompt"),
    (C, good(model=3), 400, "invalid_type", "model"),
    (CHAT, chat(messages="hi"), 400, "invalid_type", "messages"),
    (CHAT, chat(messages=[{"content": "hi"}]), 400, "invalid_type", "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "invalid_type", None),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "invalid_value", "stream_options"),
    # missing or empty
    (C, without(good(), "prompt"), 400, "missing_required", "prompt"),
    (C, without(good(), "model"), 400, "missing_required", "model"),
    (C, good(prompt=""), 400, "empty_prompt", "prompt"),
    (C, good(prompt=[]), 400, "empty_prompt", "prompt"),
    (C, good(prompt=[[]]), 400, "empty_prompt", "prompt"),
    (CHAT, chat(messages=[]), 400, "empty_array", "messages"),
    (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "invalid_value", None),
    # out of range
    (C, good(max_tokens=0), 400, "integer_below_min_value", "max_tokens"),
    (C, good(max_tokens=-3), 400, "integer_below_min_value", "max_tokens"),
    (
        CHAT,
        {**without(chat(), "max_tokens"), "max_completion_tokens": 0},
        400,
        "integer_below_min_value",
        "max_completion_tokens",
    ),
    (CHAT, chat(max_completion_tokens=5), 400, "invalid_value", "max_completion_tokens"),
    (C, good(temperature=2.5), 400, "invalid_value", "temperature"),
    (C, good(top_p=0), 400, "invalid_value", "top_p"),
    (C, good(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value", "stop"),
    (C, good(stop=[""]), 400, "invalid_value", "stop"),
    # beyond the context (KV pool of 256 slots) or the vocabulary
    (C, good(prompt=[5] * 300), 400, "context_length_exceeded", "prompt"),
    (C, good(max_tokens=250, prompt=[5] * 10), 400, "context_length_exceeded", "max_tokens"),
    (CHAT, chat(max_tokens=10_000), 400, "context_length_exceeded", "max_tokens"),
    (C, good(prompt=[5, 96]), 400, "invalid_value", "prompt"),  # id outside the vocabulary
    (C, good(prompt=[5, -1]), 400, "invalid_value", "prompt"),
    # unsupported parameters
    (C, good(n=2), 400, "unsupported_parameter", "n"),
    (CHAT, chat(n=3), 400, "unsupported_parameter", "n"),
    (C, good(logprobs=2), 400, "unsupported_parameter", "logprobs"),
    (CHAT, chat(logprobs=True), 400, "unsupported_parameter", "logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "unsupported_parameter", "top_logprobs"),
    (C, good(best_of=2), 400, "unsupported_parameter", "best_of"),
    (C, good(echo=True), 400, "unsupported_parameter", "echo"),
    (C, good(suffix="x"), 400, "unsupported_parameter", "suffix"),
    (C, good(presence_penalty=0.5), 400, "unsupported_parameter", "presence_penalty"),
    (C, good(logit_bias={"5": 10}), 400, "unsupported_parameter", "logit_bias"),
    (C, good(prompt=["t1", "t2"]), 400, "unsupported_parameter", "prompt"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "unsupported_parameter", "tools"),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "unsupported_parameter", None),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "unsupported_parameter",
        None,
    ),
    (C, good(foo=1), 400, "unrecognized_argument", "foo"),
    # wrong model, path or method
    (C, good(model="gpt-4"), 404, "model_not_found", "model"),
    ("/v1/embeddings", good(), 404, None, None),
    # values the engine cannot use, refused before it sees them (a seed beyond 64 bits once
    # failed the sampling step of every request in its batch)
    (C, good(seed=2**64, temperature=1), 400, "invalid_value", "seed"),
    (C, good(seed=1e20, temperature=1), 400, "invalid_value", "seed"),
    (C, good(seed=2**63), 400, "invalid_value", "seed"),
    (C, good(seed=-1), 400, "invalid_value", "seed"),
    (C, good(temperature=10**400), 400, "invalid_value", "temperature"),
    (C, good(top_p=10**400), 400, "invalid_value", "top_p"),
    (C, good(presence_penalty=-(10**400)), 400, "invalid_value", "presence_penalty"),
    (C, good(max_tokens=10**4000), 400, "context_length_exceeded", "max_tokens"),
    (C, good(prompt=[5, 10**4000]), 400, "invalid_value", "prompt"),
    (C, good(stop=["x" * 257]), 400, "invalid_value", "stop"),
    (C, good(n=10**4000), 400, "unsupported_parameter", "n"),
]

# Bodies Python's json parses but no text can hold, or cannot parse at all (each once a 500
# with the exception's text in it).
RAW_CASES: list[tuple[str, bytes, str | None, str | None]] = [
    (
        C,
        b'{"model": "tiny-routed", "prompt": "a\\ud800b", "max_tokens": 2}',
        "invalid_value",
        "prompt",
    ),
    (C, b'{"model": "tiny-routed", "prompt": ["\\udfff"]}', "invalid_value", "prompt[0]"),
    (C, b'{"model": "\\ud800", "prompt": [5]}', "invalid_value", "model"),
    (C, b'{"model": "tiny-routed", "prompt": [5], "\\ud800": 1}', "invalid_value", "\\ud800"),
    (
        CHAT,
        b'{"model": "tiny-routed", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        "invalid_value",
        "messages[0].content",
    ),
    (
        CHAT,
        b'{"model": "tiny-routed", "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "\\udc00"}]}]}',
        "invalid_value",
        "messages[0].content[0].text",
    ),
    (CHAT, b'{"model": "tiny-routed", "messages": [{"role": "\\ud800"}]}', "invalid_value", None),
    (C, b"[" * 100_000, "invalid_json", None),
    (C, b'{"a": ' * 100_000, "invalid_json", None),
    (
        C,
        b'{"model": "tiny-routed", "prompt": [5], "seed": ' + b"9" * 5000 + b"}",
        "invalid_json",
        None,
    ),
    (
        C,
        b'{"model": "tiny-routed", "prompt": [5], "max_tokens": 1' + b"0" * 5000 + b"}",
        "invalid_json",
        None,
    ),
    (
        C,
        b'{"model": "tiny-routed", "prompt": [5], "temperature": NaN}',
        "invalid_value",
        "temperature",
    ),
    (
        C,
        b'{"model": "tiny-routed", "prompt": [5], "temperature": 1e999}',
        "invalid_value",
        "temperature",
    ),
    (C, b'\xff\xfe{"model": 1}', "invalid_json", None),
    (C, b'{"model": "tiny-routed", "prompt": "\xc3\x28"}', "invalid_json", None),
]
# What an exception's text looks like; no response body may contain any of it.
LEAKS = ("Traceback", "Error:", "Exception", "int_max_str_digits", "recursion", "ValueError")


def check_error(
    status: int, body: Any, want_status: int, code: str | None, param: str | None
) -> None:
    assert status == want_status, body
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    want_type = "not_found_error" if want_status == 404 else "invalid_request_error"
    assert err["type"] == want_type
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


def test_bad_requests(served: Served) -> None:
    before = len(served.handles)
    ok = post_json(served.url, C, good())
    assert ok[0] == 200
    for path, body, status, code, param in CASES:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        got_status, got = post_raw(served.url, path, raw)
        check_error(got_status, got, status, code, param)
        if isinstance(body, dict) and not any("stream" in k for k in body) and status == 400:
            # the streaming form is refused the same way, before any event is sent
            s_status, s_body = post_json(served.url, path, {**body, "stream": True})
            check_error(s_status, s_body, status, code, param)
    # nothing reached the engine but the one good request (and the engine's own refusals)
    assert len(served.handles) == before + 1
    # the server keeps serving: same answer as before, engine idle
    again = post_json(served.url, C, good())
    assert again[0] == 200 and again[1]["choices"][0]["text"] == ok[1]["choices"][0]["text"]
    served.wait_idle()


def test_malformed_bodies_get_a_400_naming_the_field(served: Served) -> None:
    before = len(served.handles)
    for path, raw, code, param in RAW_CASES:
        status, got = post_raw(served.url, path, raw)
        check_error(status, got, 400, code, param)
        text = json.dumps(got)
        assert not any(leak in text for leak in LEAKS), got
    assert len(served.handles) == before  # none reached the engine
    assert post_json(served.url, C, good())[0] == 200
    served.wait_idle()


def test_wrong_method_and_path(served: Served) -> None:
    status, body = post_raw(served.url, C, b"", method="GET")
    check_error(status, body, 405, None, None)
    status, body = post_raw(served.url, "/nope", b"", method="GET")
    check_error(status, body, 404, None, None)


def test_openai_client_sees_errors(served: Served) -> None:
    c = served.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=OK_PROMPT, max_tokens=4, n=2)
    assert e.value.status_code == 400 and "n = 2" in e.value.message
    assert e.value.code == "unsupported_parameter" and e.value.param == "n"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=[{"role": "user", "content": "t1"}])
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    r = c.completions.create(model=MODEL, prompt=OK_PROMPT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    served.wait_idle()
