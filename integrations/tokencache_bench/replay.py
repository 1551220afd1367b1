"""Replay a trace through a driver and keep every timing."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokencache_bench.driver import Driver
from tokencache_bench.trace import Trace


@dataclass
class Timings:
    name: str
    ops: tuple[str, ...]
    trace_fingerprint: str
    requests: int
    buckets: np.ndarray  # per hand-off: its L bucket
    gen_len: np.ndarray  # per hand-off: generated tokens once it is done
    per_op_ns: np.ndarray  # shape (hand-offs, ops); batched drivers: step time / hand-offs
    step_ns: np.ndarray  # per decode step (all of them, zero when no hand-off)
    step_buckets: np.ndarray  # per decode step: its L bucket
    cached_tokens: int
    expected_tokens: int
    rss_growth_bytes: int
    wall_s: float

    @property
    def total_ns(self) -> np.ndarray:
        total: np.ndarray = self.per_op_ns.sum(axis=1)
        return total


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def replay(
    factory: Callable[[Trace], Driver], trace: Trace, tick: Callable[[int], None] | None = None
) -> Timings:
    from time import perf_counter

    rss0 = _rss_bytes()
    start = perf_counter()
    driver = factory(trace)
    for r in range(trace.requests):
        driver.admit(r)
    n = len(trace.handoffs)
    per_op = np.zeros((n, len(driver.ops)), dtype=np.int64)
    step_ns = np.zeros(trace.config.max_gen, dtype=np.int64)
    i = 0
    for group in trace.steps():
        if driver.batched:
            ns = driver.step(group)
            per_op[i : i + len(group), 0] = ns // len(group)
            step_ns[group[0].step] = ns
            i += len(group)
        else:
            for h in group:
                times = driver.handoff(h)
                per_op[i] = times
                step_ns[h.step] += sum(times)
                i += 1
        if tick is not None:
            tick(len(group))
    cached = driver.cached_tokens()
    rss_growth = _rss_bytes() - rss0
    driver.close()
    wall = perf_counter() - start
    step_buckets = np.array(
        [_bucket(s + 1, trace.config.buckets) for s in range(trace.config.max_gen)]
    )
    return Timings(
        name=driver.name,
        ops=driver.ops,
        trace_fingerprint=trace.fingerprint,
        requests=trace.requests,
        buckets=np.array([h.bucket for h in trace.handoffs]),
        gen_len=np.array([h.end - trace.prompt_len for h in trace.handoffs]),
        per_op_ns=per_op,
        step_ns=step_ns,
        step_buckets=step_buckets,
        cached_tokens=cached,
        expected_tokens=trace.total_tokens(),
        rss_growth_bytes=rss_growth,
        wall_s=wall,
    )


def _bucket(gen_len: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if gen_len <= b), buckets[-1])
