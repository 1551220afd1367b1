"""Token ids to text, one token at a time, with stop strings found in the decoded text.

Decoding each new token on its own breaks multi-byte characters and word-joining decoders, so
the decoder keeps a short window (prefix_offset:read_offset) of already-emitted tokens and emits
what decoding the window plus the new tokens adds, holding text back while it ends in an
incomplete character (U+FFFD). Stop strings are searched in the decoded text, across token
boundaries; text that could still be the start of a stop string is held back from the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return str(self._tok.decode(list(ids), skip_special_tokens=self._skip))

    def push(self, token_id: int, final: bool = False) -> str:
        """Appends one token; returns the text it completes ('' while a character is partial).
        final=True flushes a trailing partial character as it decodes."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT)):
            new = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """Text of tokens still held back (a partial character at the end of generation)."""
        if self._read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += new
        return new


class StopMatcher:
    """Finds the first stop string in a growing text; says how much text is safe to show."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._checked = 0  # no stop string ends at or before this index

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts in `text`, or None."""
        if not self.stops:
            return None
        start = max(0, self._checked - self._longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self._checked = len(text)
        return min(hits) if hits else None

    def holdback(self, text: str) -> int:
        """Characters at the end of `text` that may begin a stop string (not yet shown)."""
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class TextStream:
    """A request's output text: decodes tokens, cuts at the first stop string, streams deltas.

    feed(tokens) returns how many of the tokens were used (fewer once a stop string is found:
    the token that completes it is the last one counted) and `stopped` turns True.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self._dec = IncrementalDecoder(tokenizer)
        self._stop = StopMatcher(stops)
        self.stopped = False
        self._text = ""  # decoded text, cut at the stop string once found
        self._sent = 0

    @property
    def text(self) -> str:
        return self._text

    def feed(self, tokens: Sequence[int]) -> int:
        used = 0
        for t in tokens:
            if self.stopped:
                break
            self._dec.push(t)
            used += 1
            cut = self._stop.find(self._dec.text)
            if cut is not None:
                self.stopped = True
                self._text = self._dec.text[:cut]
            else:
                self._text = self._dec.text
        return used

    def finish(self) -> None:
        """End of generation: flush a trailing partial character (unless cut at a stop)."""
        if not self.stopped:
            self._dec.flush()
            cut = self._stop.find(self._dec.text)
            if cut is not None:
                self.stopped = True
                self._text = self._dec.text[:cut]
            else:
                self._text = self._dec.text

    def delta(self, final: bool = False) -> str:
        """Text not yet sent; while not final, keeps back a possible stop-string start."""
        end = len(self._text)
        if not final and not self.stopped:
            end -= self._stop.holdback(self._text)
        out = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out
