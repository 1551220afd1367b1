"""This server as an SGLang worker, to SGLang Model Gateway (smg): GET /server_info,
/model_info and /v1/loads, and the small model's KV events published over ZMQ (kv_events.py).

smg identifies a worker's engine by /v1/models' owned_by, else by which of /server_info
(SGLang) and /version (vLLM) answer: these make this server an SGLang-protocol HTTP worker.
Only the fields a router uses are given.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .prefix_hits import PrefixHits
from .server_config import ServerConfig

if TYPE_CHECKING:
    from tokencache_routing import RoutedEngine

    from .kv_events import ZmqKVEventPublisher


class GatewayWorker:
    def __init__(
        self,
        engine: RoutedEngine,
        config: ServerConfig,
        max_context: int,
        prefix_hits: PrefixHits,
    ) -> None:
        self.engine = engine
        self.config = config
        self.max_context = max_context
        self.prefix_hits = prefix_hits
        self.kv_publisher: ZmqKVEventPublisher | None = None
        if config.kv_events is not None and config.kv_events.publisher != "null":
            from .kv_events import ZmqKVEventPublisher, enable_tree_events

            # The engine built with kv_events records from the first insert; one built without
            # gets a recording tree here, before it caches anything.
            tree = engine.small.tree if engine.kv_events else enable_tree_events(engine)
            self.kv_publisher = ZmqKVEventPublisher(tree, config.kv_events)

    def routes(self) -> list[Route]:
        return [
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
        ]

    def start(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.start()

    def shutdown(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.shutdown()

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
        import tokencache

        m = self.engine.metrics()
        used, total = self._kv_usage()
        load = {
            "dp_rank": 0,
            "num_running_reqs": int(m.get("requests_running", 0)),
            "num_waiting_reqs": int(m.get("requests_waiting", 0)),
            "num_used_tokens": used,
            "num_total_tokens": used,
            "max_total_num_tokens": total,
            "max_running_requests": self.config.max_running or 0,
            "token_usage": used / total if total else 0.0,
            "cache_hit_rate": self.prefix_hits.small_hit_rate(),
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
