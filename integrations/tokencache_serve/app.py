"""The OpenAI-compatible HTTP app (Starlette) over a RoutedEngine running its driver thread.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming or not), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics. A request is validated and tokenized in the
endpoint (refusals are OpenAI error objects), submitted to the engine, and answered by a
GenerationResponse that watches the connection: a client that leaves aborts its request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from tokencache_routing import RoutedEngine, SamplingParams

from . import DEFAULT_MODEL_NAME
from .errors import APIError, bad_request
from .generation import Chunk, Generation, GenerationError, LoopWaker
from .metrics import ServerMetrics
from .protocol import (
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    parse_chat,
    parse_completion,
    parse_json_body,
)

log = logging.getLogger("tokencache_serve")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = DEFAULT_MODEL_NAME
    completion_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    chat_max_tokens: int = 256  # /v1/chat/completions without max_tokens (capped by the context)
    default_temperature: float = 1.0  # OpenAI's default; 0 = greedy


def context_limit(engine: RoutedEngine) -> int:
    """The largest prompt + max_tokens served: the engine's KV bound and the models' positions
    (engine.max_context counts pool slots only; rotary tables end at max_position_embeddings)."""
    limit = int(engine.max_context)
    for side in engine.sides:
        limit = min(limit, int(side.model.config.max_position_embeddings))
    return limit


def create_app(
    engine: RoutedEngine,
    tokenizer: Any,
    config: ServerConfig | None = None,
    manage_engine: bool = True,
) -> Starlette:
    """manage_engine: start the engine's driver thread at startup and shut it down at exit."""
    return Server(engine, tokenizer, config or ServerConfig(), manage_engine).app


class Server:
    def __init__(
        self, engine: RoutedEngine, tokenizer: Any, config: ServerConfig, manage_engine: bool
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.manage_engine = manage_engine
        self.created = int(time.time())
        self.max_context = context_limit(engine)
        self.inflight: set[Generation] = set()  # submitted, response not finished
        self._waker: LoopWaker | None = None  # made in the serving loop (lifespan)
        self.metrics = ServerMetrics(engine.metrics)
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                APIError: self._api_error,
                HTTPException: self._http_error,
                Exception: self._internal_error,
            },
            lifespan=self._lifespan,
        )
        self.app.state.server = self

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self._waker = LoopWaker(asyncio.get_running_loop())
        if self.manage_engine:
            self.engine.start()
        log.info("serving %s (max context %d)", self.config.model_name, self.max_context)
        try:
            yield
        finally:
            if self.manage_engine:
                self.engine.shutdown()

    def _loop_waker(self) -> LoopWaker:
        if self._waker is None:  # served without lifespan events
            self._waker = LoopWaker(asyncio.get_running_loop())
        return self._waker

    def abort_all(self) -> int:
        """Aborts every request in flight (server shutdown); returns how many were running."""
        return sum(g.abort() for g in list(self.inflight))

    # ------------------------------------------------------------------------- errors

    def _error_response(self, request: Request, err: APIError) -> JSONResponse:
        self.metrics.http_requests.labels(request.url.path, str(err.status)).inc()
        log.info(
            "%s %s -> %d %s: %s",
            request.method,
            request.url.path,
            err.status,
            err.code,
            err.message,
        )
        return JSONResponse(err.body(), status_code=err.status)

    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return self._error_response(request, exc)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            msg = f"Unknown endpoint {request.method} {request.url.path}."
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            msg = str(exc.detail)
        return self._error_response(request, APIError(exc.status_code, msg))

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        err = APIError(500, f"Internal server error: {type(exc).__name__}: {exc}")
        return self._error_response(request, err)

    # ------------------------------------------------------------------ simple routes

    async def health(self, _request: Request) -> Response:
        m = self.engine.metrics()
        return JSONResponse(
            {
                "status": "ok",
                "model": self.config.model_name,
                "requests_running": m.get("requests_running", 0),
                "requests_waiting": m.get("requests_waiting", 0),
            }
        )

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tokencache",
            "max_model_len": self.max_context,
        }

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model_id"])
        return JSONResponse(self._model_card())

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist. This server serves "
                f"`{self.config.model_name}` (GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------------- generation

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse_completion(
            parse_json_body(await request.body()), self.config.default_temperature
        )
        self._check_model(req.params.model)
        ids = self._encode(req.prompt, add_special_tokens=True)
        return self._submit(request, "completion", req, ids, arrival)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse_chat(parse_json_body(await request.body()), self.config.default_temperature)
        self._check_model(req.params.model)
        ids = self._encode(self._apply_template(req.messages), add_special_tokens=False)
        return self._submit(request, "chat", req, ids, arrival)

    def _apply_template(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(
                "This model's tokenizer has no chat template; use /v1/completions.", "messages"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template itself refuses (e.g. roles out of order)
            raise bad_request(f"The chat template rejected the messages: {e}", "messages") from e
        return str(text)

    def _encode(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise bad_request(
                "Invalid 'prompt': it encodes to no tokens.", "prompt", "empty_prompt"
            )
        return [int(t) for t in ids]

    def _max_tokens(
        self, params: GenerationParams, prompt_len: int, default: int, prompt_param: str
    ) -> int:
        limit = self.max_context
        asked = params.max_tokens
        if prompt_len >= limit or (asked is not None and prompt_len + asked > limit):
            what = "" if asked is None else f" and {asked} tokens to generate"
            raise bad_request(
                f"This model's maximum context length is {limit} tokens (KV pool and positions). "
                f"However, you requested {prompt_len} prompt tokens{what}. Shorten the prompt "
                "or max_tokens.",
                prompt_param if prompt_len >= limit or asked is None else "max_tokens",
                "context_length_exceeded",
            )
        return asked if asked is not None else min(default, limit - prompt_len)

    def _submit(
        self,
        request: Request,
        kind: str,
        req: CompletionRequest | ChatRequest,
        ids: list[int],
        arrival: float,
    ) -> Response:
        p = req.params
        default = (
            self.config.chat_max_tokens if kind == "chat" else self.config.completion_max_tokens
        )
        prompt_param = "prompt" if kind == "completion" else "messages"
        max_tokens = self._max_tokens(p, len(ids), default, prompt_param)
        sampling = None
        if p.temperature > 0:
            sampling = SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=p.seed)
        try:
            gen = Generation(
                self.engine,
                self.tokenizer,
                ids,
                max_tokens,
                sampling,
                p.stop,
                self._loop_waker(),
                arrival,
            )
        except (ValueError, TypeError) as e:
            msg = f"The engine refused the request: {e}"
            raise bad_request(msg, prompt_param, "invalid_value") from e
        except RuntimeError as e:
            raise APIError(503, f"The engine is not accepting requests: {e}") from e
        return GenerationResponse(self, request.url.path, kind, p, gen)


class GenerationResponse(Response):
    """Answers one submitted request, streaming (SSE) or as one JSON body.

    A task waits on `receive` for http.disconnect for the whole response: the request is aborted
    the moment the client leaves, even while it waits for its first token.
    """

    def __init__(
        self, server: Server, endpoint: str, kind: str, params: GenerationParams, gen: Generation
    ) -> None:
        super().__init__(media_type="application/json")
        self.server = server
        self.endpoint = endpoint
        self.kind = kind
        self.params = params
        self.gen = gen
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{gen.rid}"
        self.created = int(time.time())
        self._completed = False  # the last byte is being sent: a disconnect now is not a leave
        self._status = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(self._on_disconnect)
        self.server.inflight.add(self.gen)
        try:
            if self.params.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        finally:
            watcher.cancel()
            self.server.inflight.discard(self.gen)
            self.gen.abort()  # no-op once finished; a cancelled handler must not leak KV
            self._record()

    def _on_disconnect(self, task: asyncio.Future[None]) -> None:
        if task.cancelled() or self._completed:
            return
        self.gen.client_gone = True
        self.gen.abort()

    # ------------------------------------------------------------------ rendering

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
            "model": self.server.config.model_name,
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
        choice["tokencache"] = self._extension(g.tokens, g.models)
        body = self._envelope([choice], chunk=False)
        body["usage"] = self._usage()
        return body

    # ------------------------------------------------------------------ sending

    async def _whole(self, send: Send) -> None:
        try:
            async for _ in self.gen.chunks():
                pass
        except GenerationError as e:
            self._status = 500
            await _send_json(send, 500, APIError(500, str(e)).body())
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
        except GenerationError as e:
            self._status = 500
            await _send_event(send, APIError(500, str(e)).body())
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
        g, m = self.gen, self.server.metrics
        reason = "disconnect" if g.client_gone else (g.finish_reason or "cancelled")
        status = "499" if g.client_gone else str(self._status)
        m.http_requests.labels(self.endpoint, status).inc()
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


def _dumps(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


async def _send_json(send: Send, status: int, body: Any) -> None:
    data = _dumps(body)
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
            "body": b"data: " + _dumps(body) + b"\n\n",
            "more_body": True,
        }
    )
