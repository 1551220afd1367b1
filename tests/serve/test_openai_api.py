"""The real openai client against the server: both endpoints, streaming and not, the same tokens
as RoutedEngine.generate (greedy), the extension field, usage, stop strings, sampling."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from serve_helpers import MODEL, Served, make_engine, post_json, serve

from tokencache_serve.tiny import words

MAX_NEW = 12
PROMPTS = [[5 + (7 * i + 3 * j) % 90 for j in range(4 + i % 5)] for i in range(6)]


@pytest.fixture(scope="module")
def served(tiny: Any) -> Iterator[Served]:
    with serve(tiny) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny: Any) -> Any:
    """generate() on a separate engine over the same models and router: the expected output."""
    return make_engine(tiny).generate(PROMPTS, MAX_NEW)


def ext(choice: Any) -> dict[str, Any]:
    extra = choice.model_extra or {}
    assert "tokencache" in extra, "every choice carries the tokencache extension field"
    return dict(extra["tokencache"])


def expected_text(tok: Any, tokens: list[int]) -> str:
    return str(tok.decode(tokens, skip_special_tokens=True))


def visible(tok: Any, tokens: list[int]) -> list[int]:
    """The extension's token_ids: the eos that ended a request is counted in usage, not shown."""
    return tokens[:-1] if tokens and tokens[-1] == tok.eos_token_id else tokens


def test_models_and_health(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client().models.retrieve(MODEL).id == MODEL
    status, body = post_json(served.url, "/health", {})  # POST is not allowed there
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    import urllib.request

    with urllib.request.urlopen(served.url + "/health", timeout=10) as r:
        assert r.status == 200


@pytest.mark.parametrize("as_text", [False, True])
def test_completions_match_generate(served: Served, reference: Any, as_text: bool) -> None:
    c = served.client()
    for i, p in enumerate(PROMPTS):
        prompt: Any = words(p) if as_text else p
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        (choice,) = r.choices
        x = ext(choice)
        shown = visible(served.tokenizer, reference.tokens[i])
        assert x["token_ids"] == shown
        assert x["large_token_mask"] == reference.models[i][: len(shown)]
        assert choice.text == expected_text(served.tokenizer, reference.tokens[i])
        assert choice.finish_reason == reference.finished_reasons[i]
        assert r.usage.prompt_tokens == len(p)
        assert r.usage.completion_tokens == len(reference.tokens[i])
        assert r.usage.total_tokens == len(p) + len(reference.tokens[i])
        assert r.model == MODEL and r.object == "text_completion"
    # the router did route: some tokens came from each model
    mask = [m for ms in reference.models for m in ms]
    assert 0 < sum(mask) < len(mask)


def test_completions_stream_matches_generate(served: Served, reference: Any) -> None:
    c = served.client()
    for i, p in enumerate(PROMPTS):
        stream = c.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, tokens, mask, reasons, usage = "", [], [], [], None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
                continue
            (choice,) = chunk.choices
            text += choice.text
            tokens += ext(choice)["token_ids"]
            mask += ext(choice)["large_token_mask"]
            reasons.append(choice.finish_reason)
        shown = visible(served.tokenizer, reference.tokens[i])
        assert tokens == shown and mask == reference.models[i][: len(shown)]
        assert text == expected_text(served.tokenizer, reference.tokens[i])
        assert reasons[-1] == reference.finished_reasons[i]
        assert all(r is None for r in reasons[:-1])
        assert usage is not None and usage.completion_tokens == len(reference.tokens[i])


def chat_prompt(tok: Any, content: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_generate(served: Served, tiny: Any, stream: bool) -> None:
    tok = served.tokenizer
    contents = [words(p) for p in PROMPTS[:3]]
    ref = make_engine(tiny).generate([chat_prompt(tok, t) for t in contents], MAX_NEW)
    c = served.client()
    for i, content in enumerate(contents):
        messages = [{"role": "user", "content": content}]
        if not stream:
            r = c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0
            )
            (choice,) = r.choices
            assert choice.message.role == "assistant"
            assert choice.message.content == expected_text(tok, ref.tokens[i])
            shown = visible(tok, ref.tokens[i])
            assert ext(choice)["token_ids"] == shown
            assert ext(choice)["large_token_mask"] == ref.models[i][: len(shown)]
            assert choice.finish_reason == ref.finished_reasons[i]
            assert r.usage.prompt_tokens == len(chat_prompt(tok, content))
            assert r.usage.completion_tokens == len(ref.tokens[i])  # the eos is generated work
            assert r.object == "chat.completion"
            continue
        chunks = list(
            c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        tokens = [t for ch in chunks[1:] for t in ext(ch.choices[0]).get("token_ids", [])]
        assert text == expected_text(tok, ref.tokens[i])
        assert tokens == visible(tok, ref.tokens[i])
        assert chunks[-1].choices[0].finish_reason == ref.finished_reasons[i]
        assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def tokens_until(tok: Any, tokens: list[int], stop: str) -> int:
    """How many tokens it takes for the decoded text to contain `stop`."""
    for k in range(1, len(tokens) + 1):
        if stop in tok.decode(tokens[:k], skip_special_tokens=True):
            return k
    raise AssertionError("stop string not in the output")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_and_aborts(served: Served, reference: Any, stream: bool) -> None:
    tok = served.tokenizer
    i = 1  # its greedy output has no eos in 400 tokens: only the stop string can end it
    long = 400  # the engine would take seconds to get there: the abort must come first
    assert len(reference.tokens[i]) == MAX_NEW
    full = expected_text(tok, reference.tokens[i])
    # a stop string across a token boundary: the end of token 4's word and the start of token 5's
    pieces = [tok.decode([t]) for t in reference.tokens[i]]
    stop = pieces[3][-1] + " " + pieces[4][:2]
    k = tokens_until(tok, reference.tokens[i], stop)
    want_text = full[: full.find(stop)]
    n_before = len(served.handles)
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": long}
    kw.update(temperature=0, stop=[stop, "never-there"])
    c = served.client()
    if stream:
        chunks = list(c.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].text for ch in chunks)
        tokens = [t for ch in chunks for t in ext(ch.choices[0])["token_ids"]]
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = c.completions.create(**kw)
        text, tokens, reason = (
            r.choices[0].text,
            ext(r.choices[0])["token_ids"],
            r.choices[0].finish_reason,
        )
        assert r.usage.completion_tokens == k
    assert text == want_text and stop not in text
    assert tokens == reference.tokens[i][:k]
    assert reason == "stop"
    # the request was stopped in the engine, not run to max_tokens
    h = served.handles[n_before]
    assert h.wait(10) and h.finished_reason == "abort" and len(h.tokens) < long
    served.wait_idle()


def test_max_tokens_one_and_default(served: Served, reference: Any) -> None:
    c = served.client()
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    assert ext(r.choices[0])["token_ids"] == reference.tokens[0][:1]
    assert r.usage.completion_tokens == 1
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0)  # OpenAI default 16
    assert r.usage.completion_tokens <= 16
    assert ext(r.choices[0])["token_ids"][:MAX_NEW] == reference.tokens[0]


def test_sampling_seeded(served: Served) -> None:
    c = served.client()

    def sample(seed: int) -> list[int]:
        r = c.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=1.0, seed=seed
        )
        return list(ext(r.choices[0])["token_ids"])

    a = sample(1)
    assert sample(1) == a  # same seed, same tokens
    assert any(sample(s) != a for s in (2, 3, 4))  # 96-word vocabulary: seeds differ
    r = c.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0.7, top_p=0.01
    )  # a tiny nucleus keeps only the top token: greedy
    greedy = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0)
    assert ext(r.choices[0])["token_ids"] == ext(greedy.choices[0])["token_ids"]
    served.wait_idle()
