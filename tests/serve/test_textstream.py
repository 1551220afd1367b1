"""Incremental detokenization and stop strings, on a byte-level tokenizer built in-process (one
token per byte, so characters span tokens) and on the tiny word-level one."""

from __future__ import annotations

from typing import Any

import pytest

from tokencache_serve.textstream import IncrementalDecoder, StopMatcher, TextStream
from tokencache_serve.tiny import tiny_tokenizer

TEXT = "héllo wörld 😀 naïve — ok 日本語 end"


@pytest.fixture(scope="module")
def byte_tok() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False)


def test_byte_tokens_decode_without_broken_characters(byte_tok: Any) -> None:
    ids = byte_tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode())  # one token per byte: characters span tokens
    dec = IncrementalDecoder(byte_tok)
    deltas = [dec.push(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == dec.text
    assert deltas.count("") > 0  # held back inside multi-byte characters


def test_partial_character_at_the_end_is_flushed(byte_tok: Any) -> None:
    ids = byte_tok.encode("ab😀")[:-1]  # the emoji cut short
    s = TextStream(byte_tok)
    s.feed(ids)
    assert s.delta() == "ab"
    s.finish()
    assert s.delta(final=True) == "\ufffd"  # what decoding gives, at the very end only


@pytest.mark.parametrize(
    "stops,cut",
    [
        (["wörld"], "héllo "),
        (["ö"], "héllo w"),  # a two-byte stop string
        (["😀", "llo"], "hé"),  # the earliest of several
        (["end", "日本"], "héllo wörld 😀 naïve — ok "),
        (["h"], ""),  # at the very start
        (["absent"], TEXT),
    ],
)
def test_stop_strings_across_tokens(byte_tok: Any, stops: list[str], cut: str) -> None:
    ids = byte_tok.encode(TEXT)
    s = TextStream(byte_tok, stops)
    streamed = ""
    used = 0
    for t in ids:  # one token at a time, like a stream
        used += s.feed([t])
        d = s.delta()
        assert not any(x in streamed + d for x in stops)
        streamed += d
        if s.stopped:
            break
    s.finish()
    streamed += s.delta(final=True)
    assert streamed == s.text == cut
    assert s.stopped == (cut != TEXT)
    if s.stopped:  # the token completing the stop string is the last one used
        assert any(x in byte_tok.decode(ids[:used]) for x in stops)
        assert not any(x in byte_tok.decode(ids[: used - 1]) for x in stops)


def test_feed_reports_tokens_used_within_a_batch() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("t1 t2 t3 t4 t5")
    s = TextStream(tok, ["t3 t4"])
    assert s.feed(ids) == 4 and s.stopped  # t5 is not used
    assert s.text == "t1 t2 "
    assert s.feed(ids) == 0  # nothing after a stop


def test_holdback_keeps_possible_stop_starts() -> None:
    m = StopMatcher(["abc", "xyz"])
    assert m.holdback("hello ab") == 2
    assert m.holdback("hello a") == 1
    assert m.holdback("hello x") == 1
    assert m.holdback("hello abd") == 0
    assert StopMatcher([]).holdback("abc") == 0


def test_stop_matcher_finds_across_calls() -> None:
    m = StopMatcher(["needle"])
    text = ""
    for piece in ["hay ne", "ed", "le rest"]:
        text += piece
        found = m.find(text)
    assert found == 4
