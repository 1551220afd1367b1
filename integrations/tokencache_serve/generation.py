"""One request in the routing engine, seen from asyncio.

The engine's driver thread calls the handle's listener after each batch of new tokens and once
at the end; the listener only hands the request to a LoopWaker, which hops into the event loop
(call_soon_threadsafe) and sets each woken request's asyncio.Event. The coroutine then reads what
the handle holds, decodes it and cuts at stop strings in a worker thread (a slow tokenizer never
blocks the event loop), aborts the request in the engine at a stop string, and yields chunks.

Isolation: whatever fails in one request's own work (its detokenization, stop matching) ends
that request alone, with a GenerationError; the engine and every other request go on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from tokencache_routing import RequestHandle, RoutedEngine, SamplingParams

from .textstream import TextStream

log = logging.getLogger("tokencache_serve")
T = TypeVar("T")


class GenerationError(RuntimeError):
    """The request ended without its answer: the engine failed it (500), the server's own work
    on it failed (500), or it was aborted before the end, at shutdown (503). The message is
    for the client: it never carries exception text (that goes to the log)."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


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
        *,
        pool: Executor | None = None,
        stop_token_ids: Collection[int] = (),
    ) -> None:
        """pool: where decoding and stop matching run (None: inline). stop_token_ids: the
        engine's stop tokens (eos): the one that ends a request is counted in usage but not
        shown in the extension's token_ids (it is no part of the text either)."""
        self.timing = Timing(time.perf_counter() if arrival is None else arrival)
        self._pool = pool
        self._stop_ids = frozenset(stop_token_ids)
        self.visible_tokens: list[int] = []  # tokens without the ending stop token
        self.visible_models: list[int] = []
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

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _advance(self, tokens: list[int], done: bool) -> tuple[int, bool, str]:
        """Worker thread: decode the new tokens, look for stop strings, and return (tokens used,
        stopped, text to send now). Only this request's own TextStream is touched."""
        used = self._text.feed(tokens)
        if done and not self._text.stopped:
            self._text.finish()
        final = done or self._text.stopped
        return used, self._text.stopped, self._text.delta(final)

    def _fail(self, message: str, status: int, code: str | None, reason: str) -> GenerationError:
        self.abort()
        self.finish_reason = reason  # for the server's metrics and log, never sent as such
        self.timing.finished = time.perf_counter()
        return GenerationError(message, status, code)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """New text and tokens as they come; the last chunk carries the finish reason
        ("stop" or "length"). Raises GenerationError when the request cannot end normally."""
        h = self.handle
        while self.finish_reason is None:
            await self._event.wait()
            self._event.clear()
            done = h.done()  # read before the tokens: once done, the token list is final
            n = min(len(h.tokens), len(h.models))
            new_t, new_m = h.tokens[self._seen : n], h.models[self._seen : n]
            self._seen = n
            try:
                used, stopped, text = await self._run(self._advance, new_t, done)
            except Exception:
                log.exception("rid=%d: decoding its output failed; ending this request", self.rid)
                raise self._fail(
                    "The server failed to decode this request's output.", 500, None, "error"
                ) from None
            new_t, new_m = new_t[:used], new_m[:used]
            shown_t, shown_m = new_t, new_m
            if shown_t and shown_t[-1] in self._stop_ids:  # the eos: it ended the request
                shown_t, shown_m = shown_t[:-1], shown_m[:-1]
            if new_t:
                now = time.perf_counter()
                if self.timing.first_token is None:
                    self.timing.first_token = now
                self.timing.last_token = now
                self.tokens += new_t
                self.models += new_m
                self.visible_tokens += shown_t
                self.visible_models += shown_m
            if stopped:
                h.abort()  # a stop string: nothing after it is wanted
                self.finish_reason = "stop"
            elif done:
                reason = h.finished_reason
                if reason == "error":
                    log.error("rid=%d: the engine failed it: %r", self.rid, h.error)
                    raise self._fail("The engine failed this request.", 500, None, "error")
                if reason not in ("stop", "length"):  # aborted, not by us: shutting down
                    if text or shown_t:  # what was made before it, then the error
                        yield Chunk(text, shown_t, shown_m, None)
                    raise self._fail(
                        "The request was aborted before it finished: the server is shutting "
                        "down. Retry it.",
                        503,
                        "server_shutting_down",
                        "abort",
                    )
                self.finish_reason = str(reason)
            if self.finish_reason is not None:
                self.timing.finished = time.perf_counter()
            if new_t or self.finish_reason is not None:
                yield Chunk(text, shown_t, shown_m, self.finish_reason)
