"""EngineConfig: everything RoutedEngine(small, large, router, config) is told besides its
models and its router, in one frozen value, validated on construction.

The modes are Literal-typed, so mypy refuses a misspelt one; the constructor refuses it too
(ValueError), as it refuses every other bad value and every unknown field (TypeError), naming
the field, before an engine starts. Beside the options it holds the objects the engine works
with: the tokenizer generate() decodes with, the devices to move the models to, and the
function run on each tensor-parallel shard of the large model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
import torch

from .core.scheduler_config import SchedulerConfig
from .sim.clock import GpuClock

if TYPE_CHECKING:
    from tokencache_models import CausalLM

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


def _device(name: str, v: object) -> torch.device | None:
    if v is None or isinstance(v, torch.device):
        return v
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a device name or torch.device, got {v!r}")
    try:
        return torch.device(v)
    except RuntimeError as e:
        raise ValueError(f"{name}: {e}") from None


@dataclass(frozen=True)
class EngineConfig:
    """RoutedEngine's options (the README's "Using it" names each). Validated on
    construction; `overlap=None` becomes the dispatch's default (True for "tokencache"),
    `large_tp_devices` a tuple, a device name a torch.device. `topology=None`: chosen from
    the models' devices by the engine.

    tokenizer: what generate() decodes its texts with (None: no texts). small_device,
    large_device: where the engine moves each model first (None: where it is). large_tp=N:
    the large model runs tensor-parallel over N ranks the engine starts (tp_launch.py),
    on large_tp_devices when given; configure(model) then runs on every rank's shard."""

    num_slots: int = 8192
    large_num_slots: int | None = None
    dispatch: Dispatch = "tokencache"
    scheduler: SchedulerConfig | None = None
    tokenizer: Any = field(default=None, repr=False)
    eos_token_id: int | None = None
    page_size: int = 1
    clock: ClockName | GpuClock = "steps"
    large_step_cost: float = 1.0
    mode: Mode = "events"
    topology: Topology | None = None
    small_device: str | torch.device | None = None
    large_device: str | torch.device | None = None
    host_charge: HostCharge = "serial"
    kv_events: bool = False
    overlap: bool | None = None
    large_tp: int | None = None
    large_tp_devices: Sequence[str] | None = None
    configure: Callable[[CausalLM], None] | None = None

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
        if self.tokenizer is not None and not callable(getattr(self.tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode method, got {self.tokenizer!r}")
        if self.configure is not None and not callable(self.configure):
            raise TypeError(f"configure must be callable, got {self.configure!r}")
        object.__setattr__(self, "num_slots", _positive_int("num_slots", self.num_slots))
        if self.large_num_slots is not None:
            large = _positive_int("large_num_slots", self.large_num_slots)
            object.__setattr__(self, "large_num_slots", large)
        object.__setattr__(self, "page_size", _positive_int("page_size", self.page_size))
        object.__setattr__(self, "overlap", overlap)
        object.__setattr__(self, "large_step_cost", float(cost))
        for name in ("small_device", "large_device"):
            object.__setattr__(self, name, _device(name, getattr(self, name)))
        self._check_large_tp()

    def _check_large_tp(self) -> None:
        """large_tp's companions: its ranks' devices (one per rank) and configure go with it;
        large_device does not (its ranks have theirs)."""
        if self.large_tp is None:
            if self.large_tp_devices is not None or self.configure is not None:
                raise ValueError("large_tp_devices and configure go with large_tp")
            return
        world = _positive_int("large_tp", self.large_tp)
        object.__setattr__(self, "large_tp", world)
        if self.large_device is not None:
            raise ValueError(
                "large_tp: give its ranks' devices as large_tp_devices, not large_device"
            )
        if self.large_tp_devices is not None:
            devices = self.large_tp_devices
            if isinstance(devices, str) or not isinstance(devices, Sequence):
                raise TypeError(f"large_tp_devices must be a sequence of devices, got {devices!r}")
            if len(devices) != world:
                raise ValueError(f"large_tp={world} needs {world} devices, got {list(devices)}")
            object.__setattr__(self, "large_tp_devices", tuple(devices))

    @property
    def large_slots(self) -> int:
        """The large model's KV slots (large_num_slots, else num_slots)."""
        return self.num_slots if self.large_num_slots is None else self.large_num_slots
