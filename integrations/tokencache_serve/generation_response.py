"""The HTTP response to one submitted generation: OpenAI's JSON body, or its SSE stream
(`data: {chunk}` events, then `data: [DONE]`), each choice carrying the `tokencache` extension
(which tokens the large model wrote). It watches the connection for the whole response, so a
client that leaves aborts its request at once, and records the request's metrics and log line
when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from .errors import APIError
from .generation import Chunk, Generation, GenerationError
from .metrics import ServerMetrics, endpoint_label
from .protocol import GenerationParams

log = logging.getLogger("tokencache_serve")


class GenerationResponse(Response):
    """Answers one submitted request, streaming (SSE) or as one JSON body.

    A task waits on `receive` for http.disconnect for the whole response: the request is aborted
    the moment the client leaves, even while it waits for its first token.
    """

    def __init__(
        self,
        endpoint: str,
        kind: str,
        params: GenerationParams,
        gen: Generation,
        *,
        model_name: str,
        system_fingerprint: str,
        metrics: ServerMetrics,
        inflight: set[Generation],
    ) -> None:
        """inflight: the generations being answered (the server aborts them at shutdown); this
        one is in it until its response ends."""
        super().__init__(media_type="application/json")
        self.model_name = model_name
        self.system_fingerprint = system_fingerprint
        self.metrics = metrics
        self.inflight = inflight
        self.endpoint = endpoint
        self.kind = kind
        self.params = params
        self.gen = gen
        # Unique across restarts and servers (OpenAI's ids are opaque); the engine's rid is in
        # the extension field.
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._completed = False  # the last byte is being sent: a disconnect now is not a leave
        self._started = False  # response headers sent
        self._status = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(self._on_disconnect)
        self.inflight.add(self.gen)

        async def tracked_send(message: Message) -> None:
            self._started = True
            await send(message)

        try:
            if self.params.stream:
                await self._stream(tracked_send)
            else:
                await self._whole(tracked_send)
        except Exception as exc:  # this response's own failure: it ends alone
            log.error("rid=%d: answering it failed", self.gen.rid, exc_info=exc)
            self.gen.abort()
            self._status = 500
            if not self.gen.client_gone:
                await self._send_failure(send, GenerationError("Internal server error."))
        finally:
            watcher.cancel()
            self.inflight.discard(self.gen)
            self.gen.abort()  # no-op once finished; a cancelled handler must not leak KV
            self._record()

    def _on_disconnect(self, task: asyncio.Future[None]) -> None:
        if task.cancelled() or self._completed:
            return
        self.gen.client_gone = True
        self.gen.abort()

    # ------------------------------------------------------------------ rendering

    async def _send_failure(self, send: Send, e: GenerationError) -> None:
        """The error as the response (not started yet) or as the stream's last event."""
        body = APIError(e.status, e.message, code=e.code).body()
        with contextlib.suppress(Exception):  # the client may be gone: nothing more to do
            if not self._started:
                await _send_json(send, e.status, body)
                return
            await _send_event(send, body)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def _extension(self, token_ids: list[int], models: list[int]) -> dict[str, Any]:
        return {"rid": self.gen.rid, "token_ids": token_ids, "large_token_mask": models}

    def _usage(self) -> dict[str, int]:
        n = len(self.gen.tokens)
        return {
            "prompt_tokens": self.gen.prompt_len,
            "completion_tokens": n,
            "total_tokens": self.gen.prompt_len + n,
        }

    def _object(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self._object(chunk),
            "created": self.created,
            "model": self.model_name,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }

    def _chunk_body(self, c: Chunk) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": c.text} if c.text or c.token_ids else {}
        else:
            choice["text"] = c.text
        choice["logprobs"] = None
        choice["finish_reason"] = c.finish_reason
        choice["tokencache"] = self._extension(c.token_ids, c.models)
        body = self._envelope([choice], chunk=True)
        if self.params.include_usage:
            body["usage"] = None
        return body

    def _whole_body(self) -> dict[str, Any]:
        g = self.gen
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": g.text}
        else:
            choice["text"] = g.text
        choice["logprobs"] = None
        choice["finish_reason"] = g.finish_reason
        choice["tokencache"] = self._extension(g.visible_tokens, g.visible_models)
        body = self._envelope([choice], chunk=False)
        body["usage"] = self._usage()
        return body

    # ------------------------------------------------------------------ sending

    async def _whole(self, send: Send) -> None:
        try:
            async for _ in self.gen.chunks():
                pass
        except GenerationError as e:
            self._status = e.status
            if not self.gen.client_gone:
                await self._send_failure(send, e)
            return
        if self.gen.client_gone:
            return
        self._completed = True
        await _send_json(send, 200, self._whole_body())

    async def _stream(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        if self.kind == "chat":  # OpenAI's first chunk announces the role
            first = self._envelope(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                chunk=True,
            )
            await _send_event(send, first)
        try:
            async for c in self.gen.chunks():
                if self.gen.client_gone:
                    return
                await _send_event(send, self._chunk_body(c))
        except GenerationError as e:  # OpenAI ends a failed stream with an error event
            self._status = e.status
            if not self.gen.client_gone:
                await _send_event(send, APIError(e.status, e.message, code=e.code).body())
        if self.gen.client_gone:
            return
        if self.params.include_usage and self._status == 200:
            tail = self._envelope([], chunk=True)
            tail["usage"] = self._usage()
            await _send_event(send, tail)
        self._completed = True
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    # ------------------------------------------------------------------ accounting

    def _record(self) -> None:
        g, m = self.gen, self.metrics
        reason = "disconnect" if g.client_gone else (g.finish_reason or "cancelled")
        status = "499" if g.client_gone else str(self._status)
        m.http_requests.labels(endpoint_label(self.endpoint), status).inc()
        m.requests.labels(self.endpoint, reason).inc()
        m.prompt_tokens.inc(g.prompt_len)
        m.completion_tokens.inc(len(g.tokens))
        m.completion_tokens_large.inc(g.num_large)
        if g.client_gone:
            m.disconnects.inc()
        t = g.timing
        ttft, per_token = t.ttft, t.per_token(len(g.tokens))
        if ttft is not None:
            m.ttft.observe(ttft)
        if per_token is not None:
            m.per_token.observe(per_token)
        total = time.perf_counter() - t.arrival
        m.duration.observe(total)
        log.info(
            "rid=%d %s status=%s stream=%s prompt=%d completion=%d large=%d finish=%s "
            "ttft=%s total=%.3fs",
            g.rid,
            self.endpoint,
            status,
            self.params.stream,
            g.prompt_len,
            len(g.tokens),
            g.num_large,
            reason,
            "-" if ttft is None else f"{ttft:.3f}s",
            total,
        )


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg: Message = await receive()
        if msg["type"] == "http.disconnect":
            return


def json_bytes(body: Any) -> bytes:
    """Compact JSON, UTF-8."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate somewhere: escaped, it is still valid JSON
        return json.dumps(body, separators=(",", ":")).encode()


async def _send_json(send: Send, status: int, body: Any) -> None:
    data = json_bytes(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _send_event(send: Send, body: Any) -> None:
    await send(
        {
            "type": "http.response.body",
            "body": b"data: " + json_bytes(body) + b"\n\n",
            "more_body": True,
        }
    )
