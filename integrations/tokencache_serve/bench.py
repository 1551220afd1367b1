"""Serving benchmark: the same closed-loop load through HTTP and through in-process submit, so the
HTTP layer's cost is known.

    python -m tokencache_serve.bench [--quick] [--models tiny|smollm2] [--requests 64]
        [--concurrency 16] [--prompt-len 32] [--max-new 32] [--max-running 32]

`concurrency` clients each send a request, wait for its last token and send the next, until
`requests` are done. In-process: engine.submit from client threads, token times taken in the
handle's listener. HTTP: the server (same engine settings) runs in a child process on
127.0.0.1; the clients are asyncio streams reading the SSE stream of /v1/completions (token-id
prompts: no tokenizer work on either path). Reported: requests/s, output tokens/s, time to first
token and per-token latency (mean gap after the first token, per request) p50/p99. No eos: every
request generates exactly max_new tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

SPECIALS = 5  # the tiny tokenizer's special ids: prompts avoid them


@dataclass
class Sample:
    submitted: float
    first: float | None
    last: float | None
    tokens: int


@dataclass
class Summary:
    path: str
    requests: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    # CPU time (all threads) per output token: robust where wall times are noisy (shared CPUs).
    server_cpu_ms_per_token: float  # in-process: the whole process (engine + listener)
    client_cpu_ms_per_token: float  # HTTP: the load generator's own cost, not the server's


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def summarize(
    path: str, samples: list[Sample], wall_s: float, server_cpu_s: float, client_cpu_s: float
) -> Summary:
    ttft = [1e3 * (s.first - s.submitted) for s in samples if s.first is not None]
    tpot = [
        1e3 * (s.last - s.first) / (s.tokens - 1)
        for s in samples
        if s.first is not None and s.last is not None and s.tokens > 1
    ]
    e2e = [1e3 * (s.last - s.submitted) for s in samples if s.last is not None]
    return Summary(
        path=path,
        requests=len(samples),
        wall_s=wall_s,
        requests_per_s=len(samples) / wall_s,
        tokens_per_s=sum(s.tokens for s in samples) / wall_s,
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p99_ms=_pct(ttft, 99),
        tpot_p50_ms=_pct(tpot, 50),
        tpot_p99_ms=_pct(tpot, 99),
        e2e_p50_ms=statistics.median(e2e) if e2e else float("nan"),
        server_cpu_ms_per_token=1e3 * server_cpu_s / max(1, sum(s.tokens for s in samples)),
        client_cpu_ms_per_token=1e3 * client_cpu_s / max(1, sum(s.tokens for s in samples)),
    )


# ------------------------------------------------------------------------------ set-up


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(SPECIALS, vocab) for _ in range(length)] for _ in range(n)]


def build_engine(a: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, tokenizer) for the benchmark's settings; the same in both processes."""
    import torch

    from tokencache_routing import EngineConfig, EntropyRouter, RoutedEngine
    from tokencache_routing.core.scheduler_config import SchedulerConfig

    torch.set_num_threads(a.torch_threads)
    if a.models == "tiny":
        from .tiny import tiny_pair, tiny_tokenizer

        small, large = tiny_pair(
            a.small_layers, a.large_layers, a.hidden, max_position=a.prompt_len + a.max_new + 8
        )
        tok, threshold = tiny_tokenizer(), 3.0  # 2x64 / 4x64: about 25% escalated
    else:
        from tokencache_models import CausalLM

        from .loading import load_models

        m = load_models(small_layers=24)
        assert isinstance(m.large, CausalLM)  # loaded whole (no large_tp)
        small, large, tok, threshold = m.small, m.large, m.tokenizer, 0.5
    slots = a.max_running * 2 * (a.prompt_len + a.max_new) + 1024
    eng = RoutedEngine(
        small,
        large,
        EntropyRouter(a.threshold if a.threshold is not None else threshold),
        config=EngineConfig(
            num_slots=slots,
            scheduler=SchedulerConfig(max_running=a.max_running),
            tokenizer=tok,
            eos_token_id=None,
        ),
    )
    return eng, tok


# --------------------------------------------------------------------------- in-process


def run_inprocess(eng: Any, prompts: list[list[int]], a: argparse.Namespace) -> Summary:
    samples: list[Sample] = []
    todo = list(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            s = Sample(time.perf_counter(), None, None, 0)

            def on_tokens(h: Any, s: Sample = s) -> None:  # driver thread: timestamps only
                now = time.perf_counter()
                n = len(h.tokens)
                if n and s.first is None:
                    s.first = now
                if n > s.tokens:
                    s.last, s.tokens = now, n

            h = eng.submit(prompts[i], a.max_new)
            h.add_listener(on_tokens)
            h.wait()
            with lock:
                samples.append(s)

    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=client) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return summarize("in-process submit", samples, wall, cpu, 0.0)


# -------------------------------------------------------------------------------- HTTP


async def _sse_request(host: str, port: int, body: bytes) -> Sample:
    """One streaming /v1/completions request on a fresh connection; token times per event."""
    s = Sample(time.perf_counter(), None, None, 0)
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}: {await reader.read()!r}")
    while await reader.readline() not in (b"\r\n", b""):
        pass  # headers
    while True:  # chunked body: size line, data, CRLF
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        data = await reader.readexactly(size + 2)
        now = time.perf_counter()
        for event in data.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            n = len(json.loads(event[6:])["choices"][0]["tokencache"]["token_ids"])
            if n:
                s.first = s.first or now
                s.last = now
                s.tokens += n
    writer.close()
    return s


async def _http_load(host: str, port: int, prompts: list[list[int]], a: argparse.Namespace) -> Any:
    todo = list(range(len(prompts)))
    samples: list[Sample] = []

    async def client() -> None:
        while todo:
            i = todo.pop()
            body = {
                "model": "bench",
                "prompt": prompts[i],
                "max_tokens": a.max_new,
                "temperature": 0,
                "stream": True,
            }
            samples.append(await _sse_request(host, port, json.dumps(body).encode()))

    await asyncio.gather(*(client() for _ in range(a.concurrency)))
    return samples


def _cpu_s(pid: int) -> float:
    psutil = importlib.import_module("psutil")  # untyped (no stubs): used through Any
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def run_http(
    port: int, server_pid: int, prompts: list[list[int]], a: argparse.Namespace
) -> Summary:
    t0, cpu0, server0 = time.perf_counter(), time.process_time(), _cpu_s(server_pid)
    samples = asyncio.run(_http_load("127.0.0.1", port, prompts, a))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    server = _cpu_s(server_pid) - server0
    return summarize("HTTP (SSE, child process)", samples, wall, server, cpu)


def serve_child(a: argparse.Namespace) -> None:
    """The child process: the same engine behind the app on a free loopback port."""
    from .app import create_app
    from .runner import DrainingServer, make_config
    from .server_config import ServerConfig

    eng, tok = build_engine(a)
    app = create_app(eng, tok, ServerConfig(model_name="bench"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = make_config(app, log_level="warning", access_log=False)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the stop signal
        DrainingServer(config).run(sockets=[sock])


def start_child(argv: Sequence[str]) -> tuple[subprocess.Popen[str], int]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # works uninstalled too
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokencache_serve.bench", *argv, "--serve-child"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"benchmark server did not start: {line!r}")
    port = int(line.split()[1])
    for _ in range(600):  # until /health answers
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if c.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("benchmark server did not answer /health")


# ------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--small-layers", type=int, default=2, help="tiny models only")
    ap.add_argument("--large-layers", type=int, default=4, help="tiny models only")
    ap.add_argument("--hidden", type=int, default=64, help="tiny models only")
    ap.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="entropy router threshold (default: 3.0 tiny, 0.5 smollm2)",
    )
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=4, help="requests before each measurement")
    ap.add_argument("--quick", action="store_true", help="32 requests, 8 clients, 16 tokens")
    ap.add_argument("--json", default=None, help="write the summaries to this file")
    ap.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    return ap


def child_argv(a: argparse.Namespace) -> list[str]:
    out = ["--models", a.models, "--prompt-len", str(a.prompt_len), "--max-new", str(a.max_new)]
    out += ["--max-running", str(a.max_running), "--small-layers", str(a.small_layers)]
    out += ["--large-layers", str(a.large_layers), "--hidden", str(a.hidden)]
    out += ["--torch-threads", str(a.torch_threads)]
    if a.threshold is not None:
        out += ["--threshold", str(a.threshold)]
    return out


def main(argv: Sequence[str] | None = None) -> list[Summary]:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.requests, a.concurrency, a.max_new = 32, 8, 16
    if a.serve_child:
        serve_child(a)
        return []
    proc, port = start_child(child_argv(a))  # loads while this process builds its engine
    try:
        eng, _ = build_engine(a)
        vocab = int(eng.vocab_size)
        prompts = make_prompts(a.requests, a.prompt_len, vocab)
        warm = make_prompts(a.warmup, a.prompt_len, vocab, seed=1)
        eng.start()
        try:
            if warm:
                run_inprocess(eng, warm, a)
            inproc = run_inprocess(eng, prompts, a)
        finally:
            eng.shutdown()
        m = eng.metrics()
        share = m["escalations"] / max(1.0, m["tokens_generated"])
        if warm:
            run_http(port, proc.pid, warm, a)
        http = run_http(port, proc.pid, prompts, a)
    finally:
        proc.terminate()
        proc.wait(60)
    rows = [inproc, http]
    print(
        f"{a.requests} requests, {a.concurrency} concurrent clients, prompt {a.prompt_len} "
        f"tokens, {a.max_new} new tokens, max_running {a.max_running}, models {a.models}"
        + (
            f" (small {a.small_layers}x{a.hidden}, large {a.large_layers}x{a.hidden})"
            if a.models == "tiny"
            else ""
        )
        + f"; {100 * share:.0f}% of tokens escalated"
    )
    cols: tuple[str, ...] = ("req/s", "tok/s", "TTFT p50", "TTFT p99", "per-token p50")
    cols += ("per-token p99",)
    cols += ("server CPU/token", "client CPU/token")
    print(f"| path | {' | '.join(cols)} |")
    print("|---|" + "---:|" * len(cols))
    for r in rows:
        print(
            f"| {r.path} | {r.requests_per_s:.1f} | {r.tokens_per_s:.0f} | "
            f"{r.ttft_p50_ms:.1f} ms | {r.ttft_p99_ms:.1f} ms | {r.tpot_p50_ms:.2f} ms | "
            f"{r.tpot_p99_ms:.2f} ms | {r.server_cpu_ms_per_token:.3f} ms | "
            f"{r.client_cpu_ms_per_token:.3f} ms |"
        )
    print(
        f"HTTP / in-process: throughput x{http.tokens_per_s / inproc.tokens_per_s:.2f}, "
        f"TTFT p50 +{http.ttft_p50_ms - inproc.ttft_p50_ms:.1f} ms, "
        f"per-token p50 +{http.tpot_p50_ms - inproc.tpot_p50_ms:.2f} ms, "
        f"server CPU per token +{http.server_cpu_ms_per_token - inproc.server_cpu_ms_per_token:.3f}"
        " ms"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return rows


if __name__ == "__main__":
    main()
