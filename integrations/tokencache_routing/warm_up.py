"""Warming an engine up before it serves: every CUDA graph its forwards can replay made and
run once (RoutedEngine.warm_up), and the count of forwards that still came cold
(RoutedEngine.cold_runs)."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence

import torch

from tokencache_models import CausalLM

from .core.kv import ModelSide
from .core.routers import Router
from .core.scheduler_config import SchedulerConfig
from .core.state import SMALL


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What RoutedEngine.warm_up made: graph keys made warm (captured on CUDA, their static
    path run once off it), the seconds it took, and the device memory it reserved (bytes)."""

    keys: int
    seconds: float
    memory_bytes: int


class _WarmUpBar:
    """progress(done, total) onto a tqdm bar whose total grows with each runner's keys."""

    def __init__(self, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=0, desc=f"warm-up {desc}", unit="graph", file=sys.stderr)
        self.base = self.last = 0

    def __call__(self, done: int, total: int) -> None:
        if done == 1:  # a runner's first key: its keys add to the total
            self.base += self.last
            self.bar.total = self.base + total
        self.last = done
        self.bar.n = self.base + done
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _warm_up_bar(desc: str) -> _WarmUpBar | None:
    try:
        return _WarmUpBar(desc)
    except ImportError:  # tqdm is the bench/serve extras'
        return None


def warm_up_sides(
    sides: Sequence[ModelSide],
    cfg: SchedulerConfig,
    router: Router,
    max_context: int,
    progress: bool = False,
) -> WarmUp:
    """Makes every CUDA graph the engine's forwards can replay and runs each once (its
    Triton compiles), as a server does before it listens: each side's slot table reserved
    for max_admitted requests of max_context slots (graphs hold its address), then the
    decode graphs of up to max_admitted rows and the multi-token graphs of up to
    max_admitted rows and the side's chunked-prefill budget, with the epilogue each side's
    steps ask for (the small side's for `router`). After it, a forward within those limits
    captures and compiles nothing (cold_runs stays 0). Off CUDA it runs each graph's static
    path once where the model's executor has its runners switched on, and does nothing
    otherwise. A tensor-parallel large model is left cold (its worker ranks would have to
    capture alongside). progress: a tqdm bar per side on stderr (when tqdm is installed)."""
    t0 = time.perf_counter()
    keys = 0
    cuda = [s.model.device for s in sides if s.model.device.type == "cuda"]
    before = sum(torch.cuda.memory_reserved(d) for d in cuda)
    for kind, side in enumerate(sides):
        model = side.model
        if not isinstance(model, CausalLM) or model.tp is not None:
            continue
        side.table.reserve(cfg.max_admitted + 1, max_context)
        budget = cfg.token_budget(kind)
        bar = _warm_up_bar(side.name) if progress else None
        try:
            keys += model.executor.warm_up(
                side.pool,
                side.epilogue(router if kind == SMALL else None),
                side.table,
                cfg.max_admitted,
                budget or None,
                max_context,
                bar,
            )
        finally:
            if bar is not None:
                bar.close()
    for d in cuda:
        torch.cuda.synchronize(d)
    after = sum(torch.cuda.memory_reserved(d) for d in cuda)
    return WarmUp(keys, time.perf_counter() - t0, after - before)


def cold_runs(sides: Sequence[ModelSide]) -> int:
    """Forwards that came outside every warmed graph key since warm_up (0 before it)."""
    total = 0
    for s in sides:
        if isinstance(s.model, CausalLM):
            executor = s.model.executor
            total += sum(r.cold_runs for r in executor.runners(s.pool))
            total += sum(r.cold_runs for r in executor.extend_runners(s.pool))
    return total
