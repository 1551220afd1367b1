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


class PieceTokenizer:
    """Token i decodes to pieces[i] (bytes); a decode joins the bytes and replaces broken UTF-8,
    as a byte-level tokenizer's decode does. Records how many ids each decode was given."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.decoded: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded.append(len(ids))
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_decoding_a_token_costs_a_short_window_not_the_whole_output() -> None:
    tok = PieceTokenizer([bytes([c]) for c in range(128)])
    ids = [ord(c) for c in "the quick brown fox jumps over the lazy dog " * 20]
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push(t) for t in ids) == dec.text == bytes(ids).decode()
    assert max(tok.decoded) <= 4  # the window, whatever the length so far (880 tokens)


def test_flush_returns_only_the_text_held_back() -> None:
    tok = PieceTokenizer([b"a", b"b", "é".encode()[:1]])
    dec = IncrementalDecoder(tok)
    assert dec.push(0) + dec.push(1) == "ab"
    assert dec.flush() == ""  # nothing held back
    assert dec.push(2) == ""  # a partial character
    assert dec.flush() == "\ufffd"
    assert dec.text == "ab\ufffd"


def test_the_earliest_stop_in_one_token_wins() -> None:
    tok = PieceTokenizer([b"1 ab 2 ab 3"])  # one token holds the stop string twice
    s = TextStream(tok, ["ab"])
    assert s.feed([0]) == 1 and s.stopped
    assert s.text == s.delta() == "1 "


def test_a_stream_before_its_first_token_is_empty() -> None:
    s = TextStream(PieceTokenizer([b"x"]), ["stop"])  # e.g. a wake that brought no tokens
    assert s.feed([]) == 0 and s.text == "" and s.delta() == "" and s.delta(final=True) == ""


def test_a_stop_completed_by_the_final_flush_stops_the_stream() -> None:
    # The last token completes the stop string and starts a character that never ends: the
    # text is held back until finish() flushes it, and the stop is found then.
    tok = PieceTokenizer([b"ab" + "é".encode()[:1]])
    s = TextStream(tok, ["b"])
    assert s.feed([0]) == 1 and not s.stopped and s.delta() == ""
    s.finish()
    assert s.stopped
    assert s.text == s.delta(final=True) == "a"


def test_text_held_back_for_a_stop_is_released_at_the_end() -> None:
    tok = PieceTokenizer([b"x", b"a"])
    s = TextStream(tok, ["ab"])
    assert s.feed([0, 1]) == 2 and not s.stopped
    assert s.delta() == "x"  # "a" may begin "ab": held back while the request runs
    s.finish()
    assert s.delta(final=True) == "a" and s.text == "xa"
