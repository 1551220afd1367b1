"""`tokencache serve`: the OpenAI-compatible server for routed generation.

    tokencache serve [--large smollm2|DIR|FILE.gguf] [--small DIR | --small-layers N]
                     [--router entropy:0.5|prob:0.3|neural:PATH] [--host 127.0.0.1 --port 8000]

Defaults start offline on the bundled SmolLM2-135M-Instruct (large) and its first 24 layers
(small). `python -m tokencache_serve serve ...` is the same command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("tokencache_serve")

DESCRIPTION = "tokencache: OpenAI-compatible serving of two-model token routing"


def add_serve_arguments(ap: argparse.ArgumentParser) -> None:
    m = ap.add_argument_group("models")
    m.add_argument(
        "--large",
        default="smollm2",
        help="large model: 'smollm2' (bundled GGUF, default), a checkpoint dir or a .gguf file",
    )
    m.add_argument(
        "--small",
        default=None,
        help="small model (checkpoint dir or .gguf); default: the large model's first layers",
    )
    m.add_argument(
        "--small-layers",
        type=int,
        default=24,
        help="layers of the large model used as the small one when --small is not given",
    )
    m.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the large model's)")
    m.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    m.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu) or a dtype")
    m.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    m.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads")

    e = ap.add_argument_group("engine")
    e.add_argument(
        "--router",
        default="entropy:0.5",
        help="entropy:T (escalate at entropy >= T nats), prob:P (top-1 probability < P) or "
        "neural:PATH (default entropy:0.5)",
    )
    e.add_argument("--max-running", type=int, default=32, help="requests decoding at once")
    e.add_argument("--num-slots", type=int, default=8192, help="KV pool slots (small model)")
    e.add_argument("--large-num-slots", type=int, default=None, help="default: --num-slots")
    e.add_argument("--min-large-batch", type=int, default=1, help="catch-up batch trigger")
    e.add_argument("--max-wait-steps", type=int, default=0, help="catch-up delay (small steps)")
    e.add_argument(
        "--max-wait-ms", type=float, default=0.0, help="catch-up delay (threaded mode, ms)"
    )
    e.add_argument(
        "--min-occupancy",
        type=float,
        default=0.8,
        help="launch a catch-up before parked requests leave the small batch below this share",
    )
    e.add_argument(
        "--mode",
        default="events",
        choices=["events", "threaded"],
        help="engine mode: events (deterministic) or threaded (one worker per model)",
    )

    s = ap.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME)
    s.add_argument(
        "--max-tokens-default",
        type=int,
        default=256,
        help="chat max_tokens when the request gives none (completions: 16, as OpenAI)",
    )
    s.add_argument(
        "--default-temperature",
        type=float,
        default=1.0,
        help="temperature when the request gives none (OpenAI: 1.0; 0 = greedy)",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--access-log", action="store_true", help="uvicorn's access log as well")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokencache", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sp = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(sp)
    return ap


def build_app(a: argparse.Namespace) -> Starlette:
    """Models, router, engine and app from `serve` arguments (the engine starts with the app)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from tokencache_routing import RoutedEngine
    from tokencache_routing.scheduler import SchedulerConfig

    from .app import ServerConfig, create_app
    from .loading import load_models, parse_router

    # Refuse a bad schedule before minutes of model loading.
    scheduler = SchedulerConfig(
        max_running=a.max_running,
        min_large_batch=a.min_large_batch,
        max_wait_steps=a.max_wait_steps,
        max_wait_s=a.max_wait_ms / 1e3,
        min_occupancy=a.min_occupancy,
    )
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    models = load_models(
        a.large, a.small, a.small_layers, a.device, a.dtype, a.attention_backend, a.tokenizer
    )
    log.info("loaded %s", models.description)
    engine = RoutedEngine(
        models.small,
        models.large,
        parse_router(a.router, models.small),
        num_slots=a.num_slots,
        large_num_slots=a.large_num_slots,
        scheduler=scheduler,
        tokenizer=models.tokenizer,
        eos_token_id=models.tokenizer.eos_token_id,
        mode=a.mode,
    )
    config = ServerConfig(
        model_name=a.served_model_name,
        chat_max_tokens=a.max_tokens_default,
        default_temperature=a.default_temperature,
    )
    return create_app(engine, models.tokenizer, config)


def serve(a: argparse.Namespace) -> None:
    from .runner import DrainingServer, make_config

    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_app(a)
    config = make_config(
        app, host=a.host, port=a.port, log_level=a.log_level, access_log=a.access_log
    )
    try:
        DrainingServer(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.command is None:
        ap.print_help()
        return 2
    if a.command == "serve":
        from tokencache_extras import require_or_exit

        require_or_exit(
            "starlette", "uvicorn", "prometheus_client", extra="serve", prog="tokencache"
        )
        require_or_exit("torch", extra="routing", prog="tokencache")
        try:
            serve(a)
        except (ValueError, FileNotFoundError) as e:
            print(f"tokencache serve: error: {e}", file=sys.stderr)
            return 2
    return 0
