"""The OpenAI API's routes: POST /v1/completions and /v1/chat/completions, GET /v1/models and
/v1/models/{id}.

A generation request's body is read under a size limit and a deadline, prepared (parsed,
validated, tokenized) in the prompt pool while the event loop keeps serving, submitted to the
engine and answered by a GenerationResponse; decoding and stop strings run in the output pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokencache_routing import RoutedEngine, SamplingParams

from .errors import APIError, bad_request
from .generation import Generation, LoopWaker
from .generation_response import GenerationResponse
from .metrics import ServerMetrics
from .prefix_hits import PrefixHits
from .protocol import GREEDY_BELOW, ChatRequest, CompletionRequest
from .request_body import read_json_body
from .request_preparation import RequestPreparer, check_model_name
from .server_config import ServerConfig

log = logging.getLogger("tokencache_serve")
T = TypeVar("T")


def fingerprint(model_name: str) -> str:
    """OpenAI-style system_fingerprint ("fp_" + 10 hex): changes with the served model name or
    tokencache's version, i.e. when the same seed may give other tokens."""
    import tokencache

    digest = hashlib.sha256(f"{tokencache.__version__}\0{model_name}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


class OpenAIRoutes:
    def __init__(
        self,
        engine: RoutedEngine,
        tokenizer: Any,
        config: ServerConfig,
        metrics: ServerMetrics,
        max_context: int,
        prefix_hits: PrefixHits,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.max_context = max_context
        self.created = int(time.time())
        self.system_fingerprint = config.system_fingerprint or fingerprint(config.model_name)
        eos = getattr(engine, "eos_token_id", None)
        self.stop_token_ids = frozenset(() if eos is None else (int(eos),))
        self.inflight: set[Generation] = set()  # submitted, response not finished
        self._waker: LoopWaker | None = None  # made in the serving loop
        self.preparer = RequestPreparer(
            config, tokenizer, int(engine.vocab_size), max_context, prefix_hits
        )
        # Prompts (JSON, chat template, encode) and outputs (decode, stop strings) in their own
        # threads: a huge prompt never stalls the loop, nor other requests' streams.
        n = config.tokenizer_threads
        self.prompt_pool = ThreadPoolExecutor(n, thread_name_prefix="tokencache-prompt")
        self.output_pool = ThreadPoolExecutor(n, thread_name_prefix="tokencache-output")

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
        ]

    def start(self) -> None:
        """In the serving loop, before the first request."""
        self._waker = LoopWaker(asyncio.get_running_loop())

    def shutdown(self) -> None:
        for pool in (self.prompt_pool, self.output_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def abort_all(self) -> int:
        """Aborts every request in flight; returns how many were running."""
        return sum(g.abort() for g in list(self.inflight))

    def _loop_waker(self) -> LoopWaker:
        if self._waker is None:  # served without lifespan events
            self._waker = LoopWaker(asyncio.get_running_loop())
        return self._waker

    # ------------------------------------------------------------------------ models

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
        check_model_name(request.path_params["model_id"], self.config.model_name)
        return JSONResponse(self._model_card())

    # -------------------------------------------------------------------- generation

    async def _in(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _read_body(self, request: Request) -> bytes:
        return await read_json_body(request, self.config.max_body_bytes, self.config.body_timeout_s)

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        raw = await self._read_body(request)
        req, ids, max_tokens = await self._in(self.prompt_pool, self.preparer.completion, raw)
        return self._submit(request, "completion", req, ids, max_tokens, arrival)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        raw = await self._read_body(request)
        req, ids, max_tokens = await self._in(self.prompt_pool, self.preparer.chat, raw)
        return self._submit(request, "chat", req, ids, max_tokens, arrival)

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
            # RequestPreparer validated everything; this is a fallback, its text for the log only.
            log.warning("the engine refused a validated request: %s", e)
            raise bad_request(
                "The engine refused the request.", prompt_param, "invalid_value"
            ) from None
        except RuntimeError:
            raise APIError(
                503, "The engine is not accepting requests (shutting down).", code="unavailable"
            ) from None
        return GenerationResponse(
            request.url.path,
            kind,
            p,
            gen,
            model_name=self.config.model_name,
            system_fingerprint=self.system_fingerprint,
            metrics=self.metrics,
            inflight=self.inflight,
        )
