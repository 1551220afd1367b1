"""Tree memory per cached token: tracemalloc for Python trees, RSS growth for every tree."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from tokencache_bench.driver import Driver
from tokencache_bench.report import Memory
from tokencache_bench.trace import Trace, TraceConfig


def traced_bytes_per_token(factory: Callable[[Trace], Driver], trace: Trace) -> Memory:
    """Python-heap bytes the tree keeps after replaying `trace`, per cached token.

    torch tensor storage is allocated outside the Python allocator, so tracemalloc misses the
    8-byte slot values; the figure is the tree's Python objects (nodes, keys, dicts).
    """
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    driver = factory(trace)
    for r in range(trace.requests):
        driver.admit(r)
    for h in trace.handoffs:
        driver.handoff(h)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    cached = driver.cached_tokens()
    tracemalloc.stop()
    driver.close()
    return Memory(driver.name, "tracemalloc", used / cached, cached)


def rss_in_subprocesses(
    keys: list[str], config: TraceConfig, requests: int, max_gen: int
) -> dict[str, Memory]:
    """Resident-set growth per cached token, each implementation in a fresh process replaying
    the trace's first `requests` requests up to `max_gen`. Page granular and it counts
    allocator slack, so read it as an estimate; two children run at a time."""
    spec = json.dumps({"config": {**asdict(config)}, "requests": requests, "max_gen": max_gen})

    def one(key: str) -> Memory | None:
        cmd = [sys.executable, "-m", "tokencache_bench.rss_child", key, spec]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            print(f"RSS measurement of {key} failed: {done.stderr[-500:]}", file=sys.stderr)
            return None
        out = json.loads(done.stdout.strip().splitlines()[-1])
        return Memory(out["name"], "RSS growth", out["bytes_per_token"], out["cached_tokens"])

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, keys))
    return {m.name: m for m in results if m is not None}
