"""finish_reason and usage.completion_tokens at a request's end, through the server (both
endpoints, streaming and not): an eos or a stop string on the last token allowed ends it with
"stop" (OpenAI's rule: a matched stop wins over the length), and usage counts the tokens
generated up to the one that ended the answer (its eos, or the one that completed a stop
string), not what the engine made past a stop string before its abort landed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from serve_helpers import MODEL, Served, make_engine, serve

from tokencache_routing import RequestHandle
from tokencache_routing.core.state import LARGE, SMALL
from tokencache_serve.tiny import words

MAX_NEW = 12
CANDIDATES = [[5 + (7 * i + 3 * j) % 90 for j in range(3 + i % 4)] for i in range(120)]
ENDPOINTS = ["completions", "chat"]


class DecodeAfterTheEnd:
    """The tiny tokenizer, whose decode waits until every request submitted so far has ended
    in the engine: the server then meets each stop string only after the engine made all of
    its tokens, as with a slow decode or a fast engine (what usage counts must not depend on
    which came first)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.handles: list[RequestHandle] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, *a: Any, **kw: Any) -> Any:
        for h in list(self.handles):
            assert h.wait(60), "a request did not end"
        return self._inner.decode(*a, **kw)


@pytest.fixture(scope="module")
def served(tiny: Any) -> Iterator[Served]:
    tok = DecodeAfterTheEnd(tiny[2])
    with serve((tiny[0], tiny[1], tok)) as s:
        tok.handles = s.handles  # the list serve() appends every submitted handle to
        yield s


def chat_messages(prompt: list[int]) -> list[dict[str, str]]:
    return [{"role": "user", "content": words(prompt)}]


def prompt_ids(tok: Any, endpoint: str, prompt: list[int]) -> list[int]:
    """The prompt's token ids as the server submits them."""
    if endpoint == "completions":
        return prompt
    text = tok.apply_chat_template(
        chat_messages(prompt), tokenize=False, add_generation_prompt=True
    )
    return list(tok.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def outputs(tiny: Any) -> dict[str, Any]:
    """Each candidate's greedy output (MAX_NEW tokens, or fewer ending on eos) per endpoint,
    from an engine of its own over the same models and router."""
    return {
        e: make_engine(tiny).generate([prompt_ids(tiny[2], e, p) for p in CANDIDATES], MAX_NEW)
        for e in ENDPOINTS
    }


def ask(
    served: Served,
    endpoint: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    stop: list[str] | None = None,
) -> tuple[str | None, str, list[int], Any]:
    """(finish_reason, text, the extension's token_ids, usage) of one greedy request."""
    c = served.client()
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    if stop is not None:
        kw["stop"] = stop
    chat = endpoint == "chat"
    if chat:
        create: Any = c.chat.completions.create
        kw["messages"] = chat_messages(prompt)
    else:
        create = c.completions.create
        kw["prompt"] = prompt
    if not stream:
        r = create(**kw)
        (choice,) = r.choices
        text = choice.message.content if chat else choice.text
        return choice.finish_reason, text, choice.model_extra["tokencache"]["token_ids"], r.usage
    reason, text, tokens, usage = None, "", [], None
    for chunk in create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        text += (choice.delta.content or "") if chat else choice.text
        tokens += (choice.model_extra or {}).get("tokencache", {}).get("token_ids", [])
        reason = choice.finish_reason or reason
    return reason, text, tokens, usage


def last_handle(served: Served) -> RequestHandle:
    h = served.handles[-1]
    assert h.wait(60)
    return h


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("writer", [SMALL, LARGE], ids=["small", "large"])
def test_eos_on_the_last_allowed_token_ends_with_stop(
    served: Served, outputs: dict[str, Any], writer: int, endpoint: str, stream: bool
) -> None:
    """max_tokens = the length of an output that ends on eos: the eos is also the last token
    allowed, and the answer ends "stop"; usage counts the eos (generated), token_ids do not
    show it (no part of the text)."""
    eos = served.tokenizer.eos_token_id
    res = outputs[endpoint]
    found = [
        i
        for i, (t, m) in enumerate(zip(res.tokens, res.models, strict=True))
        if t[-1] == eos and m[-1] == writer
    ]
    assert found, "no candidate whose greedy output ends on eos written by that model"
    i = found[0]
    tokens = res.tokens[i]
    reason, _, token_ids, usage = ask(served, endpoint, CANDIDATES[i], len(tokens), stream)
    h = last_handle(served)
    assert h.tokens == tokens and h.models[-1] == writer and h.finished_reason == "stop"
    assert reason == "stop"
    assert token_ids == tokens[:-1]
    assert usage.completion_tokens == len(tokens)
    served.wait_idle()


def no_eos_output(tok: Any, res: Any, start: int = 0) -> tuple[int, list[int], str]:
    """A candidate whose output has MAX_NEW tokens and no eos: (index, tokens, its text)."""
    for i in range(start, len(CANDIDATES)):
        t = res.tokens[i]
        if len(t) == MAX_NEW and tok.eos_token_id not in t:
            return i, t, str(tok.decode(t, skip_special_tokens=True))
    raise AssertionError("no candidate without eos")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_stop_string_completed_by_the_last_allowed_token_ends_with_stop(
    served: Served, outputs: dict[str, Any], endpoint: str, stream: bool
) -> None:
    """The MAX_NEW-th token completes the stop string (and makes max_tokens): "stop", the
    text cut before it, every token counted."""
    tok = served.tokenizer
    res = outputs[endpoint]
    start = 0
    while True:  # a last word that occurs nowhere before it (" t1" is also in " t15")
        i, tokens, text = no_eos_output(tok, res, start)
        stop = " " + str(tok.decode(tokens[-1:]))
        if text.find(stop) == len(text) - len(stop):
            break
        start = i + 1
    reason, got, token_ids, usage = ask(served, endpoint, CANDIDATES[i], MAX_NEW, stream, [stop])
    assert last_handle(served).tokens == tokens
    assert reason == "stop"
    assert got == text[: -len(stop)]
    assert token_ids == tokens and usage.completion_tokens == MAX_NEW
    served.wait_idle()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_usage_counts_the_tokens_up_to_the_end_of_the_answer(
    served: Served, outputs: dict[str, Any], endpoint: str, stream: bool
) -> None:
    """Without a stop string usage counts every token generated (the eos too); with one, the
    tokens up to the one that completed it, although the engine made all MAX_NEW before the
    server met the stop string (DecodeAfterTheEnd)."""
    tok = served.tokenizer
    res = outputs[endpoint]
    i, tokens, text = no_eos_output(tok, res)
    # Without a stop string: all of them.
    reason, got, token_ids, usage = ask(served, endpoint, CANDIDATES[i], MAX_NEW, stream)
    assert (reason, got, token_ids) == ("length", text, tokens)
    assert usage.completion_tokens == MAX_NEW
    # One that ends with eos: the eos counts.
    eos_ended = [j for j, t in enumerate(res.tokens) if t[-1] == tok.eos_token_id]
    j = eos_ended[0]
    reason, _, token_ids, usage = ask(served, endpoint, CANDIDATES[j], MAX_NEW, stream)
    assert reason == "stop" and token_ids == res.tokens[j][:-1]
    assert usage.completion_tokens == len(res.tokens[j])
    # A stop string that the 4th token completes, across the 3rd and 4th tokens' words.
    k = 4
    pieces = [str(tok.decode([t])) for t in tokens]
    stop = pieces[k - 2][-1] + " " + pieces[k - 1]
    assert stop not in tok.decode(tokens[: k - 1]) and stop in tok.decode(tokens[:k])
    reason, got, token_ids, usage = ask(served, endpoint, CANDIDATES[i], MAX_NEW, stream, [stop])
    h = last_handle(served)
    assert len(h.tokens) == MAX_NEW  # what the engine generated
    assert (reason, got, token_ids) == ("stop", text[: text.find(stop)], tokens[:k])
    assert usage.completion_tokens == k
    assert usage.total_tokens == usage.prompt_tokens + k
    served.wait_idle()
