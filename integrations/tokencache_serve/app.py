"""The HTTP app (Starlette) over a RoutedEngine running its driver thread: assembles the OpenAI
routes (openai_routes.py), the endpoints a gateway reads off an SGLang worker
(gateway_worker.py), GET /health and GET /metrics, the middleware (trusted hosts, CORS, API key)
and the error handlers that answer every refusal and failure as an OpenAI error object.

A failure in one request's own work ends that request alone; the event loop keeps serving
/health and every stream meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokencache_routing import RoutedEngine

from .errors import APIError
from .gateway_worker import GatewayWorker
from .generation_response import json_bytes
from .metrics import ServerMetrics, endpoint_label
from .openai_routes import OpenAIRoutes
from .prefix_hits import PrefixHits
from .protocol import shown
from .security import APIKeyMiddleware, TrustedHostMiddleware
from .server_config import ServerConfig

log = logging.getLogger("tokencache_serve")


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
        self.max_context = context_limit(engine)
        self.metrics = ServerMetrics(engine.metrics)
        prefix_hits = PrefixHits(engine, self.metrics)
        self.openai = OpenAIRoutes(
            engine, tokenizer, config, self.metrics, self.max_context, prefix_hits
        )
        self.gateway = GatewayWorker(engine, config, self.max_context, prefix_hits)
        routes = [
            *self.openai.routes(),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            *self.gateway.routes(),
        ]
        self.app = Starlette(
            routes=routes,
            middleware=self._middleware(),
            exception_handlers={
                APIError: self._api_error,
                HTTPException: self._http_error,
                Exception: self._internal_error,
            },
            lifespan=self._lifespan,
        )
        self.app.state.server = self

    def _middleware(self) -> list[Middleware]:
        config = self.config
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
        return middleware

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.openai.start()
        if self.manage_engine:
            self.engine.start()
        self.gateway.start()
        log.info("serving %s (max context %d)", self.config.model_name, self.max_context)
        try:
            yield
        finally:
            if self.manage_engine:
                self.engine.shutdown()
            self.gateway.shutdown()
            self.openai.shutdown()

    def abort_all(self) -> int:
        """Aborts every request in flight (server shutdown); returns how many were running."""
        return self.openai.abort_all()

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
        return Response(json_bytes(err.body()), err.status, err.headers, "application/json")

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

    # ----------------------------------------------------------------- server's own

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

    async def prometheus(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")
