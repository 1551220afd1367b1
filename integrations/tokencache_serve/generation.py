"""One request in the routing engine, seen from asyncio.

The engine's driver thread calls the handle's listener after each batch of new tokens and once
at the end; the listener only hands the request to a LoopWaker, which hops into the event loop
(call_soon_threadsafe) and sets each woken request's asyncio.Event. The coroutine then reads what
the handle holds, decodes it, cuts at stop strings (aborting the request in the engine at once)
and yields chunks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokencache_routing import RequestHandle, RoutedEngine, SamplingParams

from .textstream import TextStream


class GenerationError(RuntimeError):
    """The engine failed this request (finished_reason "error")."""


@dataclass
class Chunk:
    text: str  # new text (may be empty while a stop string or a character is incomplete)
    token_ids: list[int]
    models: list[int]  # per token: 1 = written by the large model
    finish_reason: str | None  # set on the last chunk


@dataclass
class Timing:
    arrival: float  # perf_counter() when the HTTP request arrived
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def per_token(self, num_tokens: int) -> float | None:
        """Mean seconds between output tokens after the first."""
        if self.first_token is None or self.last_token is None or num_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (num_tokens - 1)


class LoopWaker:
    """Wakes requests' events from the driver thread with one loop hop per burst, not one per
    request: a step that delivers tokens to 32 requests costs one self-pipe write, so the driver
    thread does not hand the GIL to the event loop 32 times in the middle of its step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Event] = []
        self._scheduled = False

    def wake(self, event: asyncio.Event) -> None:
        """Driver thread. A closed loop means the server is stopping: nobody is waiting."""
        with self._lock:
            self._pending.append(event)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for event in pending:
            event.set()


class Generation:
    """Submits at construction (engine.submit may raise ValueError/TypeError/RuntimeError)."""

    def __init__(
        self,
        engine: RoutedEngine,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams | None,
        stops: Sequence[str],
        waker: LoopWaker,
        arrival: float | None = None,
    ) -> None:
        self.timing = Timing(time.perf_counter() if arrival is None else arrival)
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.models: list[int] = []
        self.finish_reason: str | None = None
        self.client_gone = False  # set by the server when the client disconnected
        self._text = TextStream(tokenizer, stops)
        self._waker = waker
        self._event = asyncio.Event()
        self._seen = 0
        self.handle: RequestHandle = engine.submit(list(prompt_ids), max_tokens, sampling=sampling)
        self.handle.add_listener(self._wake)

    @property
    def rid(self) -> int:
        return self.handle.rid

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def num_large(self) -> int:
        return sum(self.models)

    def _wake(self, _h: RequestHandle) -> None:
        self._waker.wake(self._event)  # driver thread

    def abort(self) -> bool:
        """Stops the request in the engine (its KV is freed at the engine's next iteration)."""
        return False if self.handle.done() else self.handle.abort()

    async def chunks(self) -> AsyncIterator[Chunk]:
        """New text and tokens as they come; the last chunk carries the finish reason."""
        h = self.handle
        while self.finish_reason is None:
            await self._event.wait()
            self._event.clear()
            done = h.done()  # read before the tokens: once done, the token list is final
            n = min(len(h.tokens), len(h.models))
            new_t, new_m = h.tokens[self._seen : n], h.models[self._seen : n]
            self._seen = n
            used = self._text.feed(new_t)
            new_t, new_m = new_t[:used], new_m[:used]
            if new_t:
                now = time.perf_counter()
                if self.timing.first_token is None:
                    self.timing.first_token = now
                self.timing.last_token = now
                self.tokens += new_t
                self.models += new_m
            if self._text.stopped:
                h.abort()  # a stop string: nothing after it is wanted
                self.finish_reason = "stop"
            elif done:
                if h.finished_reason == "error":
                    self.finish_reason = "error"
                    raise GenerationError(f"the engine failed this request: {h.error!r}")
                self._text.finish()
                stopped = h.finished_reason == "stop" or self._text.stopped
                self.finish_reason = "stop" if stopped else str(h.finished_reason)
            if self.finish_reason is not None:
                self.timing.finished = time.perf_counter()
            if new_t or self.finish_reason is not None:
                final = self.finish_reason is not None
                yield Chunk(self._text.delta(final), new_t, new_m, self.finish_reason)
