"""Every server limit at its edge: a request exactly at the limit is served (200), one step past
it is refused (400, or 413 for the body's size) with the error naming the field the client
sent. Stop sequences (count, length), prompt tokens (--max-prompt-tokens and the context),
max_tokens / max_completion_tokens (--max-tokens-limit, the context, the minimum 1), n,
logprobs / top_logprobs, temperature, top_p, seed, token ids and the body's bytes."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from serve_helpers import MODEL, Served, make_engine, post_json, post_raw, serve

from tokencache_serve.tiny import TINY_VOCAB, words

C, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_PROMPT, MAX_TOKENS, MAX_BODY = 8, 5, 4096  # the capped server's limits
SLOTS = 256  # the context server's KV pools: a context of SLOTS + 1 tokens
TINY = 5e-324  # the least positive float


def good(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, **kw}


def chat(content: str = "t1 t2", **kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0, **kw}


def chat_len(tok: Any, content: str) -> int:
    """Prompt tokens of a one-message chat, as the server renders and encodes it."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return len(tok.encode(text, add_special_tokens=False))


def chat_of(tok: Any, n: int) -> str:
    """A message whose chat prompt is exactly n tokens."""
    content = words([5] * (n - chat_len(tok, "")))
    assert chat_len(tok, content) == n
    return content


def text_of(tok: Any, n: int) -> str:
    """A completion prompt (text) of exactly n tokens."""
    text = words([5] * n)
    assert len(tok.encode(text, add_special_tokens=True)) == n
    return text


@pytest.fixture(scope="module")
def capped(tiny: Any) -> Iterator[Served]:
    limits = {"max_prompt_tokens": MAX_PROMPT, "max_tokens_limit": MAX_TOKENS}
    with serve(tiny, {**limits, "max_body_bytes": MAX_BODY}) as s:
        yield s


@pytest.fixture(scope="module")
def context(tiny: Any) -> Iterator[Served]:
    with serve(tiny, num_slots=SLOTS) as s:
        yield s


def check_edge(
    served: Served, path: str, at: dict[str, Any], past: dict[str, Any], param: str, code: str
) -> None:
    """`at` is served; `past` is refused with a 400 naming `param`, streamed or not, and
    reaches nothing in the engine."""
    status, body = post_json(served.url, path, at)
    assert status == 200, body
    before = len(served.handles)
    for stream in (False, True):
        status, body = post_json(served.url, path, {**past, "stream": stream})
        assert status == 400, body
        err = body["error"]
        assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
        assert param.split("[")[0] in err["message"] or code == "context_length_exceeded", err
    assert len(served.handles) == before
    served.wait_idle()


# (case id, path, at the limit, one past it, param, code); on the capped server
CAPPED: list[tuple[str, str, dict[str, Any], dict[str, Any], str, str]] = [
    ("stop-count", C, good(stop=list("abcd")), good(stop=list("abcde")), "stop", "invalid_value"),
    (
        "stop-count-chat",
        CHAT,
        chat(stop=list("abcd")),
        chat(stop=list("abcde")),
        "stop",
        "invalid_value",
    ),
    ("stop-chars", C, good(stop=["x" * 256]), good(stop=["x" * 257]), "stop", "invalid_value"),
    (
        "prompt-ids",
        C,
        good(prompt=[5] * MAX_PROMPT),
        good(prompt=[5] * (MAX_PROMPT + 1)),
        "prompt",
        "context_length_exceeded",
    ),
    (
        "max-tokens",
        C,
        good(max_tokens=MAX_TOKENS),
        good(max_tokens=MAX_TOKENS + 1),
        "max_tokens",
        "invalid_value",
    ),
    (
        "max-tokens-chat",
        CHAT,
        chat(max_tokens=MAX_TOKENS),
        chat(max_tokens=MAX_TOKENS + 1),
        "max_tokens",
        "invalid_value",
    ),
    (
        "max-completion-tokens",
        CHAT,
        {**chat(max_tokens=None), "max_completion_tokens": MAX_TOKENS},
        {**chat(max_tokens=None), "max_completion_tokens": MAX_TOKENS + 1},
        "max_completion_tokens",
        "invalid_value",
    ),
    (
        "max-tokens-min",
        C,
        good(max_tokens=1),
        good(max_tokens=0),
        "max_tokens",
        "integer_below_min_value",
    ),
    (
        "max-completion-tokens-min",
        CHAT,
        {**chat(max_tokens=None), "max_completion_tokens": 1},
        {**chat(max_tokens=None), "max_completion_tokens": 0},
        "max_completion_tokens",
        "integer_below_min_value",
    ),
    ("n-max", C, good(n=1), good(n=2), "n", "unsupported_parameter"),
    ("n-max-chat", CHAT, chat(n=1), chat(n=2), "n", "unsupported_parameter"),
    ("n-min", C, good(n=1), good(n=0), "n", "invalid_value"),
    ("logprobs", C, good(logprobs=None), good(logprobs=0), "logprobs", "unsupported_parameter"),
    (
        "logprobs-chat",
        CHAT,
        chat(logprobs=False),
        chat(logprobs=True),
        "logprobs",
        "unsupported_parameter",
    ),
    (
        "top-logprobs-chat",
        CHAT,
        chat(top_logprobs=None),
        chat(top_logprobs=0),
        "top_logprobs",
        "unsupported_parameter",
    ),
    (
        "temperature-max",
        C,
        good(temperature=2.0, seed=1),
        good(temperature=math.nextafter(2.0, 3.0), seed=1),
        "temperature",
        "invalid_value",
    ),
    (
        "temperature-min",
        C,
        good(temperature=0.0),
        good(temperature=-TINY),
        "temperature",
        "invalid_value",
    ),
    (
        "top-p-max",
        C,
        good(temperature=1, top_p=1.0, seed=1),
        good(temperature=1, top_p=math.nextafter(1.0, 2.0), seed=1),
        "top_p",
        "invalid_value",
    ),
    (
        "top-p-min",
        C,
        good(temperature=1, top_p=TINY, seed=1),
        good(temperature=1, top_p=0.0, seed=1),
        "top_p",
        "invalid_value",
    ),
    (
        "seed-max",
        C,
        good(temperature=1, seed=2**63 - 1),
        good(temperature=1, seed=2**63),
        "seed",
        "invalid_value",
    ),
    (
        "seed-min",
        C,
        good(temperature=1, seed=0),
        good(temperature=1, seed=-1),
        "seed",
        "invalid_value",
    ),
    (
        "token-id-max",
        C,
        good(prompt=[TINY_VOCAB - 1]),
        good(prompt=[TINY_VOCAB]),
        "prompt",
        "invalid_value",
    ),
    ("token-id-min", C, good(prompt=[0]), good(prompt=[-1]), "prompt", "invalid_value"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "path,at,past,param,code", [c[1:] for c in CAPPED], ids=[c[0] for c in CAPPED]
)
def test_at_the_limit_served_one_past_refused(
    capped: Served, path: str, at: dict[str, Any], past: dict[str, Any], param: str, code: str
) -> None:
    check_edge(capped, path, at, past, param, code)


@pytest.mark.timeout(120)
def test_prompt_token_limit_counts_tokens_not_words(capped: Served) -> None:
    """--max-prompt-tokens on a text prompt and on a chat's rendered prompt."""
    tok = capped.tokenizer
    at, past = text_of(tok, MAX_PROMPT), text_of(tok, MAX_PROMPT + 1)
    check_edge(capped, C, good(prompt=at), good(prompt=past), "prompt", "context_length_exceeded")
    at, past = chat_of(tok, MAX_PROMPT), chat_of(tok, MAX_PROMPT + 1)
    check_edge(capped, CHAT, chat(at), chat(past), "messages", "context_length_exceeded")


def post_chunked(url: str, path: str, body: bytes) -> tuple[int, Any]:
    """A POST whose body is sent chunked, without a Content-Length: its size is known only
    as it arrives."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", path, iter([body[:100], body[100:]]), headers, encode_chunked=True)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_body_bytes_at_the_limit_served_one_more_refused(capped: Served, framing: str) -> None:
    """Announced (refused before it is read) or found while reading (chunked)."""
    post = post_raw if framing == "content-length" else post_chunked
    pad = len(json.dumps({**good(), "user": ""}).encode())
    at = json.dumps({**good(), "user": "u" * (MAX_BODY - pad)}).encode()
    assert len(at) == MAX_BODY
    status, body = post(capped.url, C, at)
    assert status == 200, body
    past = json.dumps({**good(), "user": "u" * (MAX_BODY - pad + 1)}).encode()
    status, body = post(capped.url, C, past)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(MAX_BODY) in body["error"]["message"]
    capped.wait_idle()


@pytest.mark.timeout(120)
def test_the_narrowest_nucleus_is_the_top_token(capped: Served, tiny: Any) -> None:
    """top_p = the least positive float is accepted (> 0) and keeps the most likely token:
    the greedy answer (it was 0 in the sampler's float32, which kept nothing and drew the
    least likely token)."""
    want = make_engine(tiny, eos_token_id=None).generate([[5, 6, 7]], MAX_TOKENS).tokens[0]
    for top_p in (TINY, 1e-45):
        body = good(temperature=1, top_p=top_p, seed=3, max_tokens=MAX_TOKENS)
        status, r = post_json(capped.url, C, body)
        assert status == 200, r
        shown = r["choices"][0]["tokencache"]["token_ids"]
        assert shown == want[: len(shown)] and r["usage"]["completion_tokens"] >= len(shown)
    capped.wait_idle()


@pytest.mark.timeout(180)
def test_prompt_and_max_tokens_at_the_context(context: Served) -> None:
    """The context is SLOTS + 1 tokens: prompt + max_tokens exactly that is served, one more
    refused (naming max_tokens, or max_completion_tokens if that is what was sent); a prompt
    of the whole context is refused (naming the prompt)."""
    limit = SLOTS + 1
    prompt = [5] * (limit - 1)
    check_edge(
        context,
        C,
        good(prompt=prompt, max_tokens=1),
        good(prompt=prompt, max_tokens=2),
        "max_tokens",
        "context_length_exceeded",
    )
    check_edge(
        context,
        C,
        good(prompt=prompt, max_tokens=None),  # the default, capped by the context: 1
        good(prompt=[5] * limit, max_tokens=None),
        "prompt",
        "context_length_exceeded",
    )
    content = chat_of(context.tokenizer, limit - 3)
    at = {**chat(content, max_tokens=None), "max_completion_tokens": 3}
    past = {**chat(content, max_tokens=None), "max_completion_tokens": 4}
    check_edge(context, CHAT, at, past, "max_completion_tokens", "context_length_exceeded")
