"""`tokencache serve`: the OpenAI-compatible server for routed generation.

    tokencache serve [--large smollm2|DIR|FILE.gguf] [--small DIR | --small-layers N]
                     [--router entropy:0.5|prob:0.3|neural:PATH] [--host 127.0.0.1 --port 8000]
                     [--large-tp N] [--chunked-prefill-size N] [--large-chunked-prefill-size N]

Defaults start offline on the bundled SmolLM2-135M-Instruct (large) and its first 24 layers
(small). `python -m tokencache_serve serve ...` is the same command.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from . import DEFAULT_MODEL_NAME
from .apikey import API_KEY_ENV, api_key
from .placement import DEFAULT_MEM_FRACTION

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from .kv_events import KVEventsConfig
    from .server_config import ServerConfig

log = logging.getLogger("tokencache_serve")
CPU_SLOTS = 8192  # KV slots of each pool on the CPU when --num-slots is not given

DESCRIPTION = "tokencache: OpenAI-compatible serving of two-model token routing"


def add_serve_arguments(ap: argparse.ArgumentParser) -> None:
    m = ap.add_argument_group("models")
    m.add_argument(
        "--large",
        default="smollm2",
        help="large model: 'smollm2' (bundled GGUF, default), a checkpoint dir or a .gguf file "
        "('tiny': tiny random models, for tests and benchmarks)",
    )
    m.add_argument(
        "--small",
        default=None,
        help="small model (checkpoint dir or .gguf), or exit:PATH (the large model's first "
        "layers + an early-exit head); default: the large model's first layers",
    )
    m.add_argument(
        "--small-layers",
        type=int,
        default=24,
        help="layers of the large model used as the small one when --small is not given",
    )
    m.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the large model's)")
    m.add_argument("--device", default="cpu", help="cpu or cuda[:i]: where the models load")
    m.add_argument(
        "--small-device",
        default=None,
        help="the small model's device (default: --device), e.g. cuda:0",
    )
    m.add_argument(
        "--large-device",
        default=None,
        help="the large model's device (default: --device), e.g. cuda:1: two GPUs, the models "
        "running at once (each KV pool on its model's GPU)",
    )
    m.add_argument(
        "--large-tp",
        type=int,
        default=1,
        metavar="N",
        help="run the large model tensor-parallel over N processes the server starts (on CUDA "
        "cuda:1..N beside the small model on --device cuda:0, NCCL; on the CPU gloo over "
        "127.0.0.1); a checkpoint dir is read by slice on each rank (give --small to skip "
        "loading it whole). A rank that dies fails the requests with an error. Default 1",
    )
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
    e.add_argument(
        "--num-slots",
        type=int,
        default=None,
        help="KV pool slots (small model); default: on a GPU from its memory "
        "(--mem-fraction-static), on the CPU 8192",
    )
    e.add_argument("--large-num-slots", type=int, default=None, help="default: --num-slots")
    e.add_argument(
        "--mem-fraction-static",
        type=float,
        default=DEFAULT_MEM_FRACTION,
        metavar="F",
        help="on a GPU, the share of its memory for the weights and the KV pools (the rest: "
        "activations, CUDA graphs); the pools get what the weights leave of it "
        f"(default {DEFAULT_MEM_FRACTION}, as SGLang's --mem-fraction-static)",
    )
    e.add_argument("--min-large-batch", type=int, default=1, help="catch-up batch trigger")
    e.add_argument("--max-wait-steps", type=int, default=0, help="catch-up delay (small steps)")
    e.add_argument(
        "--max-wait-ms", type=float, default=0.0, help="catch-up delay (threaded mode, ms)"
    )
    e.add_argument(
        "--min-occupancy",
        type=float,
        default=0.5,
        help="launch a catch-up before parked requests leave the small batch below this share",
    )
    e.add_argument(
        "--chunked-prefill-size",
        type=token_budget,
        default=None,
        metavar="N",
        help="most tokens one small-model step computes: a long prompt is split across steps "
        "so that decoding requests are not stalled behind it, as SGLang's "
        "--chunked-prefill-size; 0: no budget (default: the engine's, 2048)",
    )
    e.add_argument(
        "--large-chunked-prefill-size",
        type=token_budget,
        default=None,
        metavar="N",
        help="most tokens one large-model catch-up computes; 0: no budget (default: "
        "--chunked-prefill-size's). On one device a smaller one shortens the small model's "
        "stalls behind long catch-ups",
    )
    e.add_argument(
        "--mode",
        default="events",
        choices=["events", "threaded"],
        help="engine mode: events (deterministic) or threaded (one worker per model)",
    )
    e.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="skip the warm-up before listening (RoutedEngine.warm_up: every CUDA graph the "
        "engine can replay captured and every kernel it launches compiled, so that no request "
        "pays for them); for tests and quick starts",
    )
    e.add_argument(
        "--triton-cache-dir",
        default=None,
        metavar="DIR",
        help="where Triton keeps its compiled kernels across restarts (sets TRITON_CACHE_DIR; "
        "default: $TRITON_CACHE_DIR, else Triton's ~/.triton/cache). A restart with a warm "
        "cache compiles nothing; delete the directory to clear it",
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

    lim = ap.add_argument_group("limits (one client cannot hold up the others)")
    lim.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body; a larger one gets 413 before it is read (default 8 MiB)",
    )
    lim.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="most prompt tokens per request (400 beyond); default: what the context allows",
    )
    lim.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens accepted (400 beyond); default: what the context allows",
    )
    lim.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds for a request's line and headers to arrive, else the connection is "
        "closed (default 10)",
    )
    lim.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request's whole body to arrive, else 408 (default 30)",
    )
    lim.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="open connections; beyond, a request gets 503 and its connection is closed "
        "(default 512)",
    )
    lim.add_argument(
        "--tokenizer-threads",
        type=int,
        default=2,
        help="threads for prompts (parse, tokenize) and as many for outputs (decode, stop "
        "strings), off the event loop (default 2)",
    )

    sec = ap.add_argument_group("security")
    sec.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise); "
        f"default: the {API_KEY_ENV} environment variable, else no key",
    )
    sec.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host header values served (others get 400); '*' for any. "
        "Default: localhost, 127.0.0.1 and ::1 when --host is a loopback address (a web page "
        "rebinding its DNS to this machine is refused), else any",
    )
    sec.add_argument(
        "--allowed-origins",
        default=None,
        help="comma-separated origins allowed by CORS (e.g. https://app.example); default: "
        "none (browsers may not read responses from other origins)",
    )
    gw = ap.add_argument_group("behind a gateway (SGLang Model Gateway, the `gateway` extra)")
    gw.add_argument(
        "--kv-events-config",
        default=None,
        help="publish the small model's KV events as an SGLang worker does: SGLang's JSON, e.g. "
        '\'{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": true}\' (with '
        "--replicas, replica k's ports are offset by k, as SGLang offsets DP ranks)",
    )
    gw.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="start N servers (ports --replica-base-port + k) and SGLang Model Gateway (smg) on "
        "--host/--port in front of them (default 0: one server, no gateway)",
    )
    gw.add_argument(
        "--replica-base-port", type=int, default=None, help="first replica's port (--port + 1)"
    )
    gw.add_argument(
        "--gateway-policy",
        default="cache_aware",
        help="smg --policy: cache_aware (default), round_robin, random, power_of_two, ...",
    )
    gw.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `smg launch` (repeat; e.g. --gateway-arg=--log-level=debug)",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--access-log", action="store_true", help="uvicorn's access log as well")


def token_budget(text: str) -> int:
    """argparse type of the chunked-prefill budgets: an integer >= 0 (0: no budget)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: off), got {text!r}")
    return n


class ChunkOptions(TypedDict, total=False):
    chunked_prefill_size: int
    large_chunked_prefill_size: int


def chunk_options(a: argparse.Namespace) -> ChunkOptions:
    """The chunked-prefill budgets given on the command line, as SchedulerConfig keywords (a
    budget not given keeps the engine's default)."""
    out = ChunkOptions()
    if a.chunked_prefill_size is not None:
        out["chunked_prefill_size"] = a.chunked_prefill_size
    if a.large_chunked_prefill_size is not None:
        out["large_chunked_prefill_size"] = a.large_chunked_prefill_size
    return out


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def warn_if_exposed(host: str, key: str | None) -> bool:
    """Logs a warning (and returns True) for a non-loopback host served without a key."""
    if is_loopback(host) or key is not None:
        return False
    log.warning(
        "serving on %s without an API key: anyone who can reach this port can generate; "
        "set --api-key or %s",
        host,
        API_KEY_ENV,
    )
    return True


def server_config(a: argparse.Namespace) -> ServerConfig:
    from .security import LOOPBACK_HOSTS
    from .server_config import ServerConfig

    origins = tuple(o.strip() for o in (a.allowed_origins or "").split(",") if o.strip())
    hosts: tuple[str, ...] | None
    if a.allowed_hosts is None:
        hosts = LOOPBACK_HOSTS if is_loopback(a.host) else None
    else:
        hosts = tuple(h.strip() for h in a.allowed_hosts.split(",") if h.strip())
        hosts = None if "*" in hosts else hosts
    return ServerConfig(
        model_name=a.served_model_name,
        chat_max_tokens=a.max_tokens_default,
        default_temperature=a.default_temperature,
        max_body_bytes=a.max_body_bytes,
        body_timeout_s=a.body_timeout,
        max_prompt_tokens=a.max_prompt_tokens,
        max_tokens_limit=a.max_tokens_limit,
        api_key=api_key(a),
        allowed_origins=origins,
        allowed_hosts=hosts,
        tokenizer_threads=a.tokenizer_threads,
        kv_events=kv_events_config(a),
        max_running=a.max_running,
    )


def kv_events_config(a: argparse.Namespace) -> KVEventsConfig | None:
    if a.kv_events_config is None:
        return None
    from .kv_events import KVEventsConfig

    return KVEventsConfig.from_json(a.kv_events_config)


def check_limits(a: argparse.Namespace) -> None:
    for name in ("header_timeout", "body_timeout"):
        if not getattr(a, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if a.max_connections < 1:
        raise ValueError("--max-connections must be >= 1")


def pool_sizes(
    a: argparse.Namespace,
    small: Any,
    large: Any,
    small_device: Any,
    large_device: Any,
) -> tuple[int, int | None]:
    """(--num-slots, --large-num-slots), the unset ones from the GPU's memory
    (placement.kv_slots) when a model is on CUDA, else the CPU default (8192, the same)."""
    from tokencache_models import KVPool

    from .placement import PoolNeed, kv_slots

    if a.num_slots is not None and (a.large_num_slots is not None or a.large_tp > 1):
        return a.num_slots, a.large_num_slots
    on_cuda = small_device.type == "cuda" or (large_device.type == "cuda" and a.large_tp == 1)
    if not on_cuda:
        return a.num_slots or CPU_SLOTS, a.large_num_slots
    needs = [PoolNeed("small", small_device, KVPool.bytes_per_slot(small.config, small.dtype))]
    if a.large_tp == 1:  # a tensor-parallel large model's pool is its ranks': given or default
        large_bytes = KVPool.bytes_per_slot(large.config, large.dtype)
        needs.append(PoolNeed("large", large_device, large_bytes))
    slots = kv_slots(needs, a.mem_fraction_static)
    log.info("KV pools from device memory: %s", slots)
    n_small = a.num_slots if a.num_slots is not None else slots["small"]
    n_large = a.large_num_slots if a.large_num_slots is not None else slots.get("large")
    return n_small, n_large


def build_app(a: argparse.Namespace) -> Starlette:
    """Models, router, engine and app from `serve` arguments (the engine starts with the app),
    the engine warmed up unless --no-warm-up: the server listens (and /health answers) only
    once nothing is left to capture or compile."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.triton_cache_dir:  # before anything imports triton
        os.environ["TRITON_CACHE_DIR"] = os.path.expanduser(a.triton_cache_dir)
    import torch

    from tokencache_routing import EngineConfig, RoutedEngine
    from tokencache_routing.core.scheduler_config import SchedulerConfig

    from .app import create_app
    from .loading import load_models, parse_router

    # Refuse a bad schedule or limit before minutes of model loading.
    check_limits(a)
    config = server_config(a)
    scheduler = SchedulerConfig(
        max_running=a.max_running,
        min_large_batch=a.min_large_batch,
        max_wait_steps=a.max_wait_steps,
        max_wait_s=a.max_wait_ms / 1e3,
        min_occupancy=a.min_occupancy,
        **chunk_options(a),
    )
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    if a.large_tp < 1:
        raise ValueError(f"--large-tp must be >= 1, got {a.large_tp}")
    models = load_models(
        a.large,
        a.small,
        a.small_layers,
        a.device,
        a.dtype,
        a.attention_backend,
        a.tokenizer,
        large_tp=a.large_tp,
    )
    log.info("loaded %s", models.description)
    tp = {"large_tp": a.large_tp} if a.large_tp > 1 else {}
    small_device = torch.device(a.small_device or a.device)
    large_device = torch.device(a.large_device or a.device)
    # Each model on its device first: the pools are sized from what its weights leave there.
    small_model = models.small.to(small_device)
    large = models.large  # a shard factory under --large-tp: its ranks load it themselves
    large_model = large.to(large_device) if isinstance(large, torch.nn.Module) else large
    num_slots, large_num_slots = pool_sizes(a, small_model, large_model, small_device, large_device)
    engine = RoutedEngine(
        small_model,
        large_model,
        parse_router(a.router, small_model),
        config=EngineConfig(
            num_slots=num_slots,
            large_num_slots=large_num_slots,
            scheduler=scheduler,
            tokenizer=models.tokenizer,
            eos_token_id=models.tokenizer.eos_token_id,
            mode=a.mode,
            kv_events=config.kv_events is not None and config.kv_events.publisher != "null",
            **tp,
        ),
    )
    if a.warm_up:
        done = engine.warm_up(progress=True)
        log.info(
            "warmed up: %d graph keys in %.1f s, %.0f MiB of device memory",
            done.keys,
            done.seconds,
            done.memory_bytes / 2**20,
        )
    return create_app(engine, models.tokenizer, config)


def serve(a: argparse.Namespace, argv: Sequence[str] = ()) -> None:
    from .runner import DrainingServer, make_config

    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if a.replicas:
        from .replicas import serve_fleet

        serve_fleet(a, argv)
        return
    warn_if_exposed(a.host, api_key(a))
    app = build_app(a)
    config = make_config(
        app,
        header_timeout_s=a.header_timeout,
        max_connections=a.max_connections,
        host=a.host,
        port=a.port,
        log_level=a.log_level,
        access_log=a.access_log,
    )
    try:
        DrainingServer(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
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
            serve(a, argv)
        except (ValueError, FileNotFoundError) as e:
            print(f"tokencache serve: error: {e}", file=sys.stderr)
            return 2
    return 0
