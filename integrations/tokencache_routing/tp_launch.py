"""EngineConfig(large_tp=N): the engine starts its large model's tensor-parallel group itself.

`start_large_tp` spawns N - 1 worker ranks (tokencache_models.parallel.runtime.launch) and returns
rank 0's shard, which the engine uses as its large model; `LargeTP` ties the group's life to
the engine's: a worker that dies ends every request of the engine with TPWorkerLost (those
inside a forward through the forward's own error, the others, running or waiting, through
their failure, at the driver's next iteration) and refuses new ones; `stop()` (from
RoutedEngine.shutdown) stops and joins the workers, killing any still there after a bound.

The large model given may be
- a CausalLM (the whole model, loaded once here): each worker receives a copy through the
  spawn (fine for small models and tests) and cuts its shard, rank 0 cuts its own;
- a shard factory (TPGroup, device) -> CausalLM, picklable: runtime.CheckpointShard(path)
  reads only each rank's slices of a checkpoint's safetensors (what a large model needs),
  runtime.ShardOf(fn) shards what fn() builds on every rank.

Devices: on CUDA the large model's ranks take cuda:1 .. cuda:N when there are N + 1 devices
(cuda:0 being the small model's), else cuda:0 .. cuda:N-1; NCCL for the forward's
collectives. Off CUDA every rank is on the CPU, over gloo on 127.0.0.1.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from tokencache_models import CausalLM
from tokencache_models.parallel.runtime import (
    DEFAULT_TIMEOUT_S,
    ShardFactory,
    ShardOf,
    TPDriver,
    TPWorkerLost,
    launch,
)

from .config import EngineConfig

# Waited for the scheduler's lock when failing every request (a driver thread holds it while
# its forward fails: gloo reports a dead peer at once, NCCL once the watchdog aborted).
_LOCK_WAIT_S = 10.0


class FailsRequests(Protocol):
    """What the group's hold asks of its engine (RoutedEngine implements it)."""

    def fail_all(self, error: BaseException, lock_wait_s: float | None = None) -> None:
        """Every unfinished request ends with `error`; waits lock_wait_s for the lock."""
        ...


@dataclass(frozen=True)
class WholeModel:
    """A picklable `full` for ShardOf: the model itself (copied to each worker by the spawn)."""

    model: CausalLM

    def __call__(self) -> CausalLM:
        return self.model


def default_devices(world: int) -> list[str]:
    """The large model's rank devices: cuda:1..world beside the small model's cuda:0 when the
    machine has world + 1 GPUs, cuda:0..world-1 when it has world, else the CPU."""
    if not torch.cuda.is_available():
        return ["cpu"] * world
    n = torch.cuda.device_count()
    if n < world:
        raise ValueError(f"large_tp={world} needs {world} CUDA devices, this machine has {n}")
    first = 1 if n > world else 0
    return [f"cuda:{first + r}" for r in range(world)]


def start_large_tp(
    large: CausalLM | ShardFactory,
    world: int,
    devices: Sequence[str] | None = None,
    configure: Callable[[CausalLM], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CausalLM:
    """Rank 0's shard of `large` over `world` ranks, its workers running (model.tp drives
    them). configure(model) runs on every rank's shard (switches that must agree on all
    ranks, e.g. decode_padding); it and a factory must be picklable."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"large_tp must be a positive int, got {world!r}")
    if world == 1 and devices is None and isinstance(large, CausalLM):
        if configure is not None:
            configure(large)
        return large  # no group, and the model stays where it is
    devices = list(devices) if devices is not None else default_devices(world)
    if len(devices) != world:
        raise ValueError(f"large_tp={world} needs {world} devices, got {devices}")
    cuda = [torch.device(d).type == "cuda" for d in devices]
    if any(cuda) and not all(cuda):
        raise ValueError(f"the large model's ranks must all be on CUDA or all off it: {devices}")
    backend = "nccl" if all(cuda) else "gloo"
    if world == 1:  # no group: the model (or the factory's shard) as it is
        if isinstance(large, CausalLM):
            model = large.to(torch.device(devices[0]))
        else:
            from tokencache_models.parallel.tp_layers import TPGroup

            model = large(TPGroup(0, 1), torch.device(devices[0]))
        if configure is not None:
            configure(model)
        return model
    if isinstance(large, CausalLM):
        if large.tp_group is not None:
            raise ValueError("large_tp: give the whole model (or a shard factory), not a shard")
        # Rank 0 calls it here (the model itself); the workers get copies through the spawn.
        factory: ShardFactory = ShardOf(WholeModel(large))
    else:
        factory = large
    return launch(
        factory, world, devices, backend=backend, timeout_s=timeout_s, configure=configure
    )


def engine_large(
    engine: FailsRequests, large: CausalLM | ShardFactory, config: EngineConfig
) -> tuple[CausalLM, LargeTP | None]:
    """RoutedEngine's large model: `large` itself without config.large_tp, else rank 0's
    shard of its group (started here) and the engine's hold on it. EngineConfig checked
    large_tp's companions (large_tp_devices, configure, no large_device)."""
    if config.large_tp is None:
        return cast(CausalLM, large), None  # a model (or a test's stand-in for one)
    model = start_large_tp(large, config.large_tp, config.large_tp_devices, config.configure)
    return model, (LargeTP(engine, model) if model.tp is not None else None)


class LargeTP:
    """The engine's hold on its large model's group (RoutedEngine._large_tp). The workers are
    also stopped when the engine is garbage-collected (or its constructor failed) and at the
    interpreter's exit."""

    def __init__(self, engine: FailsRequests, model: CausalLM) -> None:
        assert isinstance(model.tp, TPDriver)
        self.driver: TPDriver = model.tp
        self.world = model.tp.tp.world
        self._engine = weakref.ref(engine)
        self._stopped = False
        self.driver.on_lost = self._lost
        weakref.finalize(engine, self.stop)  # holds self, not the engine

    def check(self) -> None:
        """Raises TPWorkerLost once the group is lost (a new request could never finish)."""
        if self.driver.lost is not None and not self._stopped:
            raise TPWorkerLost(self.driver.lost)

    def _lost(self, why: str) -> None:
        eng = self._engine()
        if eng is not None:
            eng.fail_all(TPWorkerLost(why), lock_wait_s=_LOCK_WAIT_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops and joins the workers (killed past timeout_s); once."""
        if self._stopped:
            return
        self._stopped = True
        self.driver.shutdown(timeout_s)
