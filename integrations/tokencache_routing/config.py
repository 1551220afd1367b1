"""EngineConfig: RoutedEngine's options in one frozen, validated value.

RoutedEngine(small, large, router, config=EngineConfig(...)) and the keyword constructor
(RoutedEngine(small, large, router, dispatch="naive", ...)) are the same: the keywords build
an EngineConfig. The modes are Literal-typed, so mypy refuses a misspelt one; the constructor
refuses it too (ValueError), as it refuses every other bad value, before anything starts.
What is not an option but an object the engine works with (the models, the router, the
tokenizer, the devices to move the models to, a per-shard configure function) stays a keyword
of RoutedEngine."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal, get_args

import numpy as np

from .core.scheduler import SchedulerConfig
from .sim.clock import GpuClock

Dispatch = Literal["tokencache", "naive", "naive-sglang"]
Mode = Literal["events", "threaded"]
ClockName = Literal["steps", "measured", "gpu"]
Topology = Literal["one-device", "two-devices"]
HostCharge = Literal["serial", "overlap", "trees"]

# "naive-sglang": the naive protocol through SGLang's own RadixCache (naive_sglang.py).
DISPATCHES: tuple[str, ...] = get_args(Dispatch)
MODES: tuple[str, ...] = get_args(Mode)
CLOCKS: tuple[str, ...] = get_args(ClockName)
TOPOLOGIES: tuple[str, ...] = get_args(Topology)
HOST_CHARGES: tuple[str, ...] = get_args(HostCharge)


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class EngineConfig:
    """RoutedEngine's options (the README's "Using it" names each). Validated on
    construction; `overlap=None` becomes the dispatch's default (True for "tokencache"),
    `large_tp_devices` a tuple. `topology=None`: chosen from the models' devices by the
    engine."""

    num_slots: int = 8192
    large_num_slots: int | None = None
    dispatch: Dispatch = "tokencache"
    scheduler: SchedulerConfig | None = None
    eos_token_id: int | None = None
    page_size: int = 1
    clock: ClockName | GpuClock = "steps"
    large_step_cost: float = 1.0
    mode: Mode = "events"
    topology: Topology | None = None
    host_charge: HostCharge = "serial"
    kv_events: bool = False
    overlap: bool | None = None
    large_tp: int | None = None
    large_tp_devices: Sequence[str] | None = None

    def __post_init__(self) -> None:
        host_charge, dispatch, mode = self.host_charge, self.dispatch, self.mode
        if host_charge not in HOST_CHARGES:
            raise ValueError(f"host_charge must be one of {HOST_CHARGES}, got {host_charge!r}")
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {', '.join(map(repr, DISPATCHES))}")
        if mode not in MODES:
            raise ValueError("mode must be 'events' (deterministic) or 'threaded'")
        if mode == "threaded" and dispatch != "tokencache":
            raise ValueError("mode='threaded' needs dispatch='tokencache' (naive has a barrier)")
        overlap = self.overlap
        if overlap is None:
            overlap = dispatch == "tokencache"
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool or None, got {overlap!r}")
        if overlap and dispatch != "tokencache":
            raise ValueError("overlap=True needs dispatch='tokencache' (naive has a barrier)")
        clock = self.clock
        if not isinstance(clock, GpuClock) and clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS} or a GpuClock, got {clock!r}")
        if self.topology is not None and self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        cost = self.large_step_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost > 0:
            raise ValueError(f"large_step_cost must be a positive number, got {cost!r}")
        if not math.isfinite(cost):
            raise ValueError(f"large_step_cost must be finite, got {cost!r}")
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerConfig):
            raise TypeError("scheduler must be a SchedulerConfig")
        object.__setattr__(self, "num_slots", _positive_int("num_slots", self.num_slots))
        if self.large_num_slots is not None:
            large = _positive_int("large_num_slots", self.large_num_slots)
            object.__setattr__(self, "large_num_slots", large)
        object.__setattr__(self, "page_size", _positive_int("page_size", self.page_size))
        object.__setattr__(self, "overlap", overlap)
        object.__setattr__(self, "large_step_cost", float(cost))
        if self.large_tp_devices is not None:
            object.__setattr__(self, "large_tp_devices", tuple(self.large_tp_devices))

    @property
    def large_slots(self) -> int:
        """The large model's KV slots (large_num_slots, else num_slots)."""
        return self.num_slots if self.large_num_slots is None else self.large_num_slots


# The options' defaults as declared (overlap None: the dispatch's default).
DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(EngineConfig)}
