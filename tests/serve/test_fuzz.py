"""Hypothesis over request bodies: JSON of any shape in the known fields and others, strings with
lone surrogates, huge and non-finite numbers, deep nesting, raw bytes. Whatever comes, the
answer is never a 5xx, every refusal is OpenAI's error object without exception text, and the
server still answers (and gives the same tokens) afterwards. Bounded: 120 examples, each a
request of at most a few tokens to a tiny model over loopback."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import MODEL, make_engine

from tokencache_serve import ServerConfig, create_app
from tokencache_serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from tokencache_serve.runner import BackgroundServer

C, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}

surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1)
strings = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", MODEL, "t1 t2 t3", "user", "text", "none", "stop", "<eos>"]),
    st.builds(lambda a, b: a + b, st.text(max_size=4), surrogates),
)
numbers = st.one_of(
    st.integers(-5, 300),
    st.integers(),
    st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 10**4000, -(10**4000)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-300, 5e-324, 1e300, 0.5, 2.0, 1e20]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, strings)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | values},
    optional={"content": st.one_of(strings, values, st.just([{"type": "text", "text": "t1"}]))},
)
FIELDS = sorted(COMPLETION_FIELDS | CHAT_FIELDS)
LEAK = re.compile(
    r"Traceback|\b(Recursion|Unicode\w*|Value|Type|Overflow|Key|Index|Attribute|Runtime)Error\b"
)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from([C, CHAT]))
    kind = draw(st.integers(0, 11))
    if kind == 0:  # raw bytes
        return path, draw(st.binary(max_size=40))
    if kind == 1:  # deep nesting, or a number with too many digits
        n = draw(st.sampled_from([100_000, 5_000, 2_000]))
        return path, draw(st.sampled_from([b"[" * n, b'{"a":' * n, b'{"seed": ' + b"7" * n + b"}"]))
    if kind <= 5:  # a valid body with one field set to anything: gets past the most checks
        body: dict[str, Any] = dict(GOOD)
        if path == CHAT:
            body.pop("prompt")
            body["messages"] = [{"role": "user", "content": "t1 t2"}]
        # half the time a field whose text reaches the tokenizer, the template or a message
        texty = st.sampled_from(["content", "content", "model", "stop", "user"])
        field = draw(texty | st.sampled_from([*sorted(body), *FIELDS]))
        value = draw(st.one_of(values, strings, surrogates))
        if field == "content":
            body["messages" if path == CHAT else "prompt"] = (
                [{"role": "user", "content": value}] if path == CHAT else value
            )
        else:
            body[field] = value
        return path, json.dumps(body).encode()
    body = {"model": MODEL}
    if path == C:
        body["prompt"] = draw(st.one_of(strings, st.lists(numbers, max_size=5), values))
    else:
        body["messages"] = draw(st.one_of(st.lists(message, max_size=3), values))
    body.update(draw(st.dictionaries(st.sampled_from(FIELDS), values, max_size=4)))
    body.update(draw(st.dictionaries(strings, values, max_size=1)))
    return path, json.dumps(body).encode()  # ensure_ascii: surrogates as \udXXX escapes


def send(url: str, path: str, data: bytes) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url + path, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("content-type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read()


@pytest.fixture(scope="module")
def srv(tiny: Any) -> Iterator[BackgroundServer]:
    config = ServerConfig(
        model_name=MODEL,
        completion_max_tokens=3,
        chat_max_tokens=3,
        max_tokens_limit=6,  # whatever gets through generates a few tokens only
        default_temperature=0.0,
    )
    app = create_app(make_engine(tiny, num_slots=2048), tiny[2], config)
    with BackgroundServer(app) as s:
        yield s


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=bodies())
def test_never_a_5xx(srv: BackgroundServer, case: tuple[str, bytes]) -> None:
    path, data = case
    status, ctype, raw = send(srv.url, path, data)
    assert status < 500, (status, raw[:500])
    if status >= 400:
        body = json.loads(raw)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert not LEAK.search(raw.decode()), raw  # no exception text
    elif "event-stream" in ctype:
        assert raw.endswith(b"data: [DONE]\n\n")
        for event in raw.split(b"\n\n")[:-2]:
            chunk = json.loads(event.removeprefix(b"data: "))
            assert "error" not in chunk, chunk
    else:
        assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")


def test_still_answers_after_the_fuzz(srv: BackgroundServer) -> None:
    """Runs after test_never_a_5xx (file order): same tokens as a fresh request gets."""
    first = send(srv.url, C, json.dumps(GOOD).encode())
    assert first[0] == 200
    with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok"
    second = send(srv.url, C, json.dumps(GOOD).encode())
    ids = [json.loads(x[2])["choices"][0]["tokencache"]["token_ids"] for x in (first, second)]
    assert ids[0] == ids[1] and len(ids[0]) == 3
