"""Cache-aware vs round-robin routing over the same multi-prompt trace: `tokencache serve`
replicas (tiny random models) behind SGLang Model Gateway, one fleet per policy.

    python -m tokencache_serve.gateway_bench [--quick] [--models tiny] [--replicas 2] [--prompts 16]
        [--system-len 192] [--requests 128] [--concurrency 8] [--max-new 16] [--num-slots 2048]

The trace: `prompts` system prompts of `system-len` words (one token each with the tiny
models), `requests` requests that each take one of them (seeded shuffle, every prompt equally
often) plus a short question of their own, sent as streaming /v1/completions by `concurrency`
closed-loop clients to the gateway. Each replica's KV pool (`num-slots`) holds about half of
the prompts: routing decides whether the fleet's cache holds each prompt once (partitioned) or
every replica churns through all of them. Reported per policy: the prefix hit rate (prompt
tokens the replica's small model had cached at arrival / prompt tokens looked up, from each
replica's /metrics), requests per replica, requests/s, TTFT p50 / p99 and end-to-end p50 at
the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .replicas import Fleet, gateway_command, replica_command

MODEL = "bench-routed"
Timing = tuple[float, float | None, float]  # submitted, first token, last byte


@dataclass
class Result:
    policy: str
    requests: int
    wall_s: float
    prefix_hit_rate: float
    requests_per_replica: list[int]
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float


def make_trace(a: argparse.Namespace) -> list[str]:
    rng = random.Random(a.seed)
    systems = [
        " ".join(f"t{rng.randrange(90)}" for _ in range(a.system_len)) for _ in range(a.prompts)
    ]
    order = [i % a.prompts for i in range(a.requests)]
    rng.shuffle(order)
    return [f"{systems[p]} t{rng.randrange(90)} t{k % 90}" for k, p in enumerate(order)]


async def sse(host: str, port: int, body: bytes) -> Timing:
    """(submitted, first token, last byte) of one streaming request on its own connection."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"gateway answered {status!r}: {(await reader.read())[:300]!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    buf, first = b"", None
    while True:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            data = await reader.readexactly(size + 2) if size else b""
            data = data[:-2]
        else:
            data = await reader.read(65536)
        if not data:
            break
        buf += data
        while b"\n\n" in buf:  # events may span chunks
            event, buf = buf.split(b"\n\n", 1)
            if first is None and event.startswith(b"data: {"):
                choice = json.loads(event[6:])["choices"]
                if choice and choice[0].get("tokencache", {}).get("token_ids"):
                    first = time.perf_counter()
    writer.close()
    return t0, first, time.perf_counter()


async def run_trace(
    host: str, port: int, prompts: list[str], a: argparse.Namespace
) -> list[Timing]:
    todo = list(reversed(range(len(prompts))))
    out: list[Timing] = []

    async def client() -> None:
        while todo:
            i = todo.pop()
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": a.max_new, "stream": True}
            out.append(await sse(host, port, json.dumps(body).encode()))

    await asyncio.gather(*(client() for _ in range(a.concurrency)))
    return out


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    want = {
        "tokencache_prompt_tokens_looked_up_total": "looked_up",
        'tokencache_prompt_tokens_cached_total{model="small"}': "cached",
    }
    got = {"looked_up": 0.0, "cached": 0.0, "requests": 0.0}
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head in want:
            got[want[head]] = float(value)
        elif head.startswith("tokencache_requests_total{"):
            got["requests"] += float(value)
    return got


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


def run_policy(policy: str, prompts: list[str], a: argparse.Namespace, log_dir: Path) -> Result:
    import socket

    socks = [socket.socket() for _ in range(a.replicas + 2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    gw, prom, *ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    model = ["--large", "tiny", "--router", "entropy:3.4"] if a.models == "tiny" else []
    args = [
        *model, "--default-temperature", "0",
        "--served-model-name", MODEL, "--num-slots", str(a.num_slots),
        "--torch-threads", "1", "--tokenizer-threads", "1", "--log-level", "warning",
    ]  # fmt: skip
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    extra = ["--log-level", "warn", "--worker-warmup-secs", "0"]
    fleet = Fleet(
        [replica_command(args, p) for p in ports],
        ports,
        gateway_command("127.0.0.1", gw, urls, policy, prom, extra),
        f"http://127.0.0.1:{gw}",
        log_dir=log_dir,
    )
    with fleet:
        fleet.start(timeout_s=300)
        t0 = time.perf_counter()
        samples = asyncio.run(run_trace("127.0.0.1", gw, prompts, a))
        wall = time.perf_counter() - t0
        per = [scrape(u) for u in urls]
    looked = sum(p["looked_up"] for p in per)
    ttft = [1e3 * (f - s) for s, f, _ in samples if f is not None]
    return Result(
        policy=policy,
        requests=len(samples),
        wall_s=wall,
        prefix_hit_rate=sum(p["cached"] for p in per) / looked if looked else 0.0,
        requests_per_replica=[int(p["requests"]) for p in per],
        ttft_p50_ms=pct(ttft, 50),
        ttft_p99_ms=pct(ttft, 99),
        e2e_p50_ms=statistics.median(1e3 * (e - s) for s, _, e in samples),
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tokencache_serve.gateway_bench")
    ap.add_argument("--policies", default="cache_aware,round_robin")
    ap.add_argument(
        "--models",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny random models, or the server's defaults (SmolLM2-135M and its first 24 "
        "layers; a prompt word is a few tokens)",
    )
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=192)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--num-slots", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="a smoke run (a few requests)")
    return ap


def main(argv: Sequence[str] | None = None) -> list[Result]:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.prompts, a.system_len, a.requests, a.concurrency, a.max_new = 4, 32, 16, 4, 4
    prompts = make_trace(a)
    results = []
    with tempfile.TemporaryDirectory(prefix="tokencache-gw-bench-") as tmp:
        for policy in a.policies.split(","):
            d = Path(tmp) / policy
            d.mkdir()
            results.append(run_policy(policy, prompts, a, d))
    print(
        f"{a.replicas} replicas ({a.models} models, {a.num_slots} KV slots each), {a.prompts} "
        f"system prompts x {a.system_len} words, {a.requests} requests, {a.concurrency} clients, "
        f"{a.max_new} new tokens\n"
    )
    print(
        "| policy | prefix hit rate | requests per replica | req/s | TTFT p50 | TTFT p99 | "
        "e2e p50 |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.policy} | {100 * r.prefix_hit_rate:.1f}% | {r.requests_per_replica} | "
            f"{r.requests / r.wall_s:.1f} | {r.ttft_p50_ms:.1f} ms | {r.ttft_p99_ms:.1f} ms | "
            f"{r.e2e_p50_ms:.1f} ms |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    sys.stdout.flush()
    return results


if __name__ == "__main__":
    main()
