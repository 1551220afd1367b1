"""The OpenAI-compatible HTTP app (Starlette) over a RoutedEngine running its driver thread.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming or not), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics, and what a gateway (SGLang Model Gateway)
probes on an SGLang worker: GET /server_info, /model_info, /v1/loads. A request body is read
under a size limit and a deadline, then parsed, validated and tokenized in a worker thread
(refusals are OpenAI error objects; the event loop keeps serving /health and every stream
meanwhile), submitted to the engine, and answered by a GenerationResponse that watches the
connection: a client that leaves aborts its request at once. A failure in one request's own
work ends that request alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from tokencache_routing import RoutedEngine, SamplingParams

from . import DEFAULT_MODEL_NAME
from .errors import APIError, bad_request
from .generation import Chunk, Generation, GenerationError, LoopWaker
from .metrics import ServerMetrics
from .protocol import (
    GREEDY_BELOW,
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    parse_chat,
    parse_completion,
    parse_json_body,
    shown,
)
from .security import APIKeyMiddleware, TrustedHostMiddleware

if TYPE_CHECKING:
    from .kv_events import KVEventsConfig, ZmqKVEventPublisher

log = logging.getLogger("tokencache_serve")


T = TypeVar("T")
MAX_BODY_BYTES = 8 * 2**20
BODY_TIMEOUT_S = 30.0
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/server_info",
    "/model_info",
    "/v1/loads",
)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = DEFAULT_MODEL_NAME
    completion_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    chat_max_tokens: int = 256  # /v1/chat/completions without max_tokens (capped by the context)
    default_temperature: float = 1.0  # OpenAI's default; 0 = greedy
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies: 413, before they are read
    body_timeout_s: float = BODY_TIMEOUT_S  # the whole body must arrive within this: else 408
    max_prompt_tokens: int | None = None  # None: what the context allows
    max_tokens_limit: int | None = None  # the largest max_tokens accepted; None: the context's
    api_key: str | None = None  # checked on every /v1 route (Authorization: Bearer KEY)
    allowed_origins: tuple[str, ...] = ()  # CORS; none by default (no CORS headers at all)
    allowed_hosts: tuple[str, ...] | None = None  # Host header values served; None: any
    tokenizer_threads: int = 2  # per pool: one for prompts, one for outputs
    system_fingerprint: str | None = None  # None: from the model name and tokencache's version
    # Publish the small model's KV events as an SGLang worker does (kv_events.py); /server_info
    # describes the publisher. None: no events.
    kv_events: KVEventsConfig | None = None
    max_running: int | None = None  # reported by /server_info and /v1/loads

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


def fingerprint(model_name: str) -> str:
    """OpenAI-style system_fingerprint ("fp_" + 10 hex): changes with the served model name or
    tokencache's version, i.e. when the same seed may give other tokens."""
    import tokencache

    digest = hashlib.sha256(f"{tokencache.__version__}\0{model_name}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


def endpoint_label(path: str) -> str:
    """A bounded metrics label: a client's arbitrary path must not create a new time series."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return path if path in ENDPOINTS else "other"


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
        self.system_fingerprint = config.system_fingerprint or fingerprint(config.model_name)
        self.vocab_size = int(engine.vocab_size)
        eos = getattr(engine, "eos_token_id", None)
        self.stop_token_ids = frozenset(() if eos is None else (int(eos),))
        self.inflight: set[Generation] = set()  # submitted, response not finished
        self._waker: LoopWaker | None = None  # made in the serving loop (lifespan)
        self.metrics = ServerMetrics(engine.metrics)
        # (prompt tokens looked up, of them cached in the small model) for /v1/loads
        self._prefix_counts = (0, 0)
        self._prefix_lock = threading.Lock()
        self.kv_publisher: ZmqKVEventPublisher | None = None
        if config.kv_events is not None and config.kv_events.publisher != "null":
            from .kv_events import ZmqKVEventPublisher, enable_tree_events

            # The engine built with kv_events records from the first insert; one built without
            # gets a recording tree here, before it caches anything.
            tree = engine.small.tree if engine.kv_events else enable_tree_events(engine)
            self.kv_publisher = ZmqKVEventPublisher(tree, config.kv_events)
        # Prompts (JSON, chat template, encode) and outputs (decode, stop strings) in their own
        # threads: a huge prompt never stalls the loop, nor other requests' streams.
        n = config.tokenizer_threads
        self.prompt_pool = ThreadPoolExecutor(n, thread_name_prefix="tokencache-prompt")
        self.output_pool = ThreadPoolExecutor(n, thread_name_prefix="tokencache-output")
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
        ]
        middleware = []
        if config.allowed_hosts is not None:
            middleware.append(Middleware(TrustedHostMiddleware, hosts=config.allowed_hosts))
        if config.allowed_origins:
            middleware.append(
                Middleware(
                    CORSMiddleware,
                    allow_origins=list(config.allowed_origins),
                    allow_methods=["GET", "POST"],
                    allow_headers=["Authorization", "Content-Type"],
                    max_age=600,
                )
            )
        if config.api_key is not None:
            middleware.append(
                Middleware(APIKeyMiddleware, api_key=config.api_key, on_refusal=self._refused)
            )
        self.app = Starlette(
            routes=routes,
            middleware=middleware,
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
        if self.kv_publisher is not None:
            self.kv_publisher.start()
        log.info("serving %s (max context %d)", self.config.model_name, self.max_context)
        try:
            yield
        finally:
            if self.manage_engine:
                self.engine.shutdown()
            if self.kv_publisher is not None:
                self.kv_publisher.shutdown()
            for pool in (self.prompt_pool, self.output_pool):
                pool.shutdown(wait=False, cancel_futures=True)

    def _loop_waker(self) -> LoopWaker:
        if self._waker is None:  # served without lifespan events
            self._waker = LoopWaker(asyncio.get_running_loop())
        return self._waker

    def abort_all(self) -> int:
        """Aborts every request in flight (server shutdown); returns how many were running."""
        return sum(g.abort() for g in list(self.inflight))

    # ------------------------------------------------------------------------- errors

    def _refused(self, path: str, status: int) -> None:
        self.metrics.http_requests.labels(endpoint_label(path), str(status)).inc()

    def _error_response(self, request: Request, err: APIError) -> Response:
        self._refused(request.url.path, err.status)
        log.info(
            "%s %s -> %d %s: %s",
            request.method,
            shown(request.url.path),
            err.status,
            err.code,
            err.message,
        )
        return Response(_dumps(err.body()), err.status, err.headers, "application/json")

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
        # The details go to the log only: a client never sees exception text.
        log.error("internal error on %s %s", request.method, shown(request.url.path), exc_info=exc)
        err = APIError(500, "Internal server error; the server log has the details.")
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

    # ------------------------------------------------ what a gateway reads off a worker
    # SGLang Model Gateway (smg) identifies a worker's engine by /v1/models' owned_by, else by
    # which of /server_info (SGLang) and /version (vLLM) answer: these make this server an
    # SGLang-protocol HTTP worker. Only the fields a router uses are given.

    def _kv_usage(self) -> tuple[int, int]:
        """(slots held by requests, pool slots) of the small model, the one that prefills
        every prompt: a cached prefix nobody pins is free to evict, so it is not load."""
        m = self.engine.metrics()
        total = int(m.get("small_kv_slots_total", 0))
        evictable = int(m.get("small_kv_slots_cached", 0)) - int(m.get("small_kv_slots_pinned", 0))
        used = int(m.get("small_kv_slots_used", 0)) - max(0, evictable)
        return max(0, used), total

    async def server_info(self, _request: Request) -> Response:
        import tokencache

        _, total = self._kv_usage()
        page = int(self.engine.small.tree.page_size)
        cfg = self.config.kv_events
        kv = None
        if cfg is not None:
            from .kv_events import describe

            kv = describe(cfg, page)
        return JSONResponse(
            {
                "served_model_name": self.config.model_name,
                "model_path": self.config.model_name,
                "tokenizer_path": None,
                "is_embedding": False,
                "page_size": page,
                "context_length": self.max_context,
                "max_total_num_tokens": total,
                "max_running_requests": self.config.max_running,
                "tp_size": 1,
                "dp_size": 1,
                "kv_events": kv,
                "kv_events_config": None if cfg is None else cfg.to_json(),
                "version": tokencache.__version__,
                "frontend": "tokencache",
            }
        )

    async def model_info(self, _request: Request) -> Response:
        cfg = self.engine.large.model.config
        return JSONResponse(
            {
                "model_path": self.config.model_name,
                "served_model_name": self.config.model_name,
                "tokenizer_path": None,
                "is_generation": True,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None),
                "architectures": None,
                "weight_version": "default",
            }
        )

    async def loads(self, _request: Request) -> Response:
        """SGLang's /v1/loads: one entry (dp_rank 0) with the core load numbers."""
        import datetime

        import tokencache

        m = self.engine.metrics()
        used, total = self._kv_usage()
        with self._prefix_lock:
            looked_up, hit = self._prefix_counts
        load = {
            "dp_rank": 0,
            "num_running_reqs": int(m.get("requests_running", 0)),
            "num_waiting_reqs": int(m.get("requests_waiting", 0)),
            "num_used_tokens": used,
            "num_total_tokens": used,
            "max_total_num_tokens": total,
            "max_running_requests": self.config.max_running or 0,
            "token_usage": used / total if total else 0.0,
            "cache_hit_rate": hit / looked_up if looked_up else 0.0,
        }
        return JSONResponse(
            {
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "version": tokencache.__version__,
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [load],
            }
        )

    def _count_cached_prefix(self, ids: list[int]) -> None:
        """Prompt tokens each model's prefix cache holds at arrival (what a prefix-aware
        gateway wins): the longest match of all but the last token, as the engine admits.
        Worker thread; the tree is thread-safe (a split keeps every handle valid)."""
        if len(ids) < 2:
            return
        head = ids[:-1]
        self.metrics.prompt_tokens_looked_up.inc(len(head))
        hits = {}
        for side in self.engine.sides:
            hits[side.name] = int(side.tree.match_prefix(head).length)
            self.metrics.prompt_tokens_cached.labels(side.name).inc(hits[side.name])
        with self._prefix_lock:
            looked_up, hit = self._prefix_counts
            self._prefix_counts = (looked_up + len(head), hit + hits.get("small", 0))

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(
                404,
                f"The model `{shown(name)}` does not exist. This server serves "
                f"`{self.config.model_name}` (GET /v1/models).",
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------------- generation

    async def _in(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _read_body(self, request: Request) -> bytes:
        """The body, if it is JSON, at most max_body_bytes and complete within body_timeout_s."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise APIError(
                415,
                "The request body must be JSON, sent with 'Content-Type: application/json'"
                f"{f' (got {shown(media)!r})' if media else ''}.",
                code="unsupported_media_type",
            )
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)  # refused before a byte of it is read
        try:
            return await asyncio.wait_for(_body_within(request, limit), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"The request body did not arrive within {self.config.body_timeout_s:g} s.",
                code="request_timeout",
                headers={"connection": "close"},
            ) from None
        except ClientDisconnect:
            raise APIError(400, "The client disconnected while sending the body.") from None

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        raw = await self._read_body(request)
        req, ids, max_tokens = await self._in(self.prompt_pool, self._prepare_completion, raw)
        return self._submit(request, "completion", req, ids, max_tokens, arrival)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        raw = await self._read_body(request)
        req, ids, max_tokens = await self._in(self.prompt_pool, self._prepare_chat, raw)
        return self._submit(request, "chat", req, ids, max_tokens, arrival)

    def _prepare_completion(self, raw: bytes) -> tuple[CompletionRequest, list[int], int]:
        """Worker thread: parse, validate, tokenize; every refusal an APIError."""
        req = parse_completion(parse_json_body(raw), self.config.default_temperature)
        self._check_model(req.params.model)
        default = self.config.completion_max_tokens
        if isinstance(req.prompt, list):  # the length limits first: before walking a long list
            self._max_tokens(req.params, len(req.prompt), default, "prompt")
        ids = self._encode(req.prompt, add_special_tokens=True)
        max_tokens = self._max_tokens(req.params, len(ids), default, "prompt")
        self._count_cached_prefix(ids)
        return req, ids, max_tokens

    def _prepare_chat(self, raw: bytes) -> tuple[ChatRequest, list[int], int]:
        req = parse_chat(parse_json_body(raw), self.config.default_temperature)
        self._check_model(req.params.model)
        ids = self._encode(self._apply_template(req.messages), add_special_tokens=False)
        max_tokens = self._max_tokens(req.params, len(ids), self.config.chat_max_tokens, "messages")
        self._count_cached_prefix(ids)
        return req, ids, max_tokens

    def _apply_template(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(
                "This model's tokenizer has no chat template; use /v1/completions.", "messages"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:
            # The template's own refusals (raise_exception: "roles must alternate") are for the
            # client; anything else failing in it is logged, not shown.
            from jinja2 import TemplateError

            if isinstance(e, TemplateError) and type(e).__name__ != "TemplateSyntaxError":
                msg = f"The chat template rejected the messages: {shown(str(e))}"
            else:
                log.warning("chat template failed", exc_info=e)
                msg = "The chat template could not render these messages."
            raise bad_request(msg, "messages") from None
        return str(text)

    def _encode(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            for i, t in enumerate(prompt):
                if not 0 <= t < self.vocab_size:
                    raise bad_request(
                        f"Invalid 'prompt': token id {shown(t)} at index {i} is outside the "
                        f"vocabulary [0, {self.vocab_size}).",
                        "prompt",
                        "invalid_value",
                    )
            return prompt
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise bad_request(
                "Invalid 'prompt': it encodes to no tokens.", "prompt", "empty_prompt"
            )
        return [int(t) for t in ids]

    def _check_prompt_len(self, prompt_len: int, prompt_param: str) -> None:
        cap = self.config.max_prompt_tokens  # beyond the context: the context's own message
        if cap is not None and cap < prompt_len < self.max_context:
            raise bad_request(
                f"This server takes at most {cap} prompt tokens "
                f"(--max-prompt-tokens); the prompt has {prompt_len}.",
                prompt_param,
                "context_length_exceeded",
            )

    def _max_tokens(
        self, params: GenerationParams, prompt_len: int, default: int, prompt_param: str
    ) -> int:
        self._check_prompt_len(prompt_len, prompt_param)
        limit = self.max_context
        asked = params.max_tokens
        name = params.max_tokens_param  # max_tokens, or the chat's max_completion_tokens
        cap = self.config.max_tokens_limit  # beyond the context: the context's own message
        if cap is not None and asked is not None and cap < asked and prompt_len + cap <= limit:
            raise bad_request(
                f"Invalid '{name}': this server generates at most {cap} "
                f"tokens per request (--max-tokens-limit), got {shown(asked)}.",
                name,
                "invalid_value",
            )
        if prompt_len >= limit or (asked is not None and prompt_len + asked > limit):
            what = "" if asked is None else f" and {shown(asked)} tokens to generate"
            raise bad_request(
                f"This model's maximum context length is {limit} tokens (KV pool and positions). "
                f"However, you requested {prompt_len} prompt tokens{what}. Shorten the prompt "
                f"or {name}.",
                prompt_param if prompt_len >= limit or asked is None else name,
                "context_length_exceeded",
            )
        if asked is not None:
            return asked
        return min(default, limit - prompt_len, cap or default)

    def _submit(
        self,
        request: Request,
        kind: str,
        req: CompletionRequest | ChatRequest,
        ids: list[int],
        max_tokens: int,
        arrival: float,
    ) -> Response:
        p = req.params
        prompt_param = "prompt" if kind == "completion" else "messages"
        sampling = None
        if p.temperature >= GREEDY_BELOW:  # logits / 1e-300 would overflow, not sample
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
                pool=self.output_pool,
                stop_token_ids=self.stop_token_ids,
            )
        except (ValueError, TypeError) as e:
            # Everything is validated above; this is a fallback, its text for the log only.
            log.warning("the engine refused a validated request: %s", e)
            raise bad_request(
                "The engine refused the request.", prompt_param, "invalid_value"
            ) from None
        except RuntimeError:
            raise APIError(
                503, "The engine is not accepting requests (shutting down).", code="unavailable"
            ) from None
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
        self.server.inflight.add(self.gen)

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
            self.server.inflight.discard(self.gen)
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
            "model": self.server.config.model_name,
            "system_fingerprint": self.server.system_fingerprint,
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
        g, m = self.gen, self.server.metrics
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


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server accepts ({limit} bytes, --max-body-bytes).",
        code="request_too_large",
    )  # the rest of the body is dropped as it comes (runner.guarded_protocol bounds how long)


async def _body_within(request: Request, limit: int) -> bytes:
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:  # a body without (or beyond) its Content-Length
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg: Message = await receive()
        if msg["type"] == "http.disconnect":
            return


def _dumps(body: Any) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate somewhere: escaped, it is still valid JSON
        return json.dumps(body, separators=(",", ":")).encode()


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
