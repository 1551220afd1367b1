"""EngineConfig: everything RoutedEngine is told besides its models and router, as one frozen,
validated value; RoutedEngine(small, large, router, config) takes nothing else."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from routing_helpers import make_prompts

from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine, SchedulerConfig


def test_the_constructor_takes_the_models_the_router_and_one_config() -> None:
    params = list(inspect.signature(RoutedEngine.__init__).parameters)
    assert params == ["self", "small", "large", "router", "config"]


def test_config_alone_builds_the_engine(pair: tuple[Any, Any]) -> None:
    small, large = pair
    sched = SchedulerConfig(max_running=4, max_parked=4)
    cfg = EngineConfig(num_slots=512, scheduler=sched, large_step_cost=2.0)
    eng = RoutedEngine(small, large, BernoulliRouter(0.3, seed=1), cfg)
    again = RoutedEngine(small, large, BernoulliRouter(0.3, seed=1), config=cfg)
    assert eng.config is cfg and again.config == cfg
    assert cfg.overlap is True  # the tokencache dispatch's default, resolved
    assert eng.sched_config is sched and eng.large_step_cost == 2.0
    assert eng.small.pool.num_slots == eng.large.pool.num_slots == 512
    prompts = make_prompts(6, seed=3)
    a = eng.generate(prompts, 8)
    b = again.generate(prompts, 8)
    assert a.tokens == b.tokens
    assert a.stats.steps == b.stats.steps


def test_no_config_means_the_defaults(pair: tuple[Any, Any]) -> None:
    eng = RoutedEngine(*pair, BernoulliRouter(0.3))
    assert eng.config == EngineConfig()
    assert eng.small.pool.num_slots == EngineConfig().num_slots


def test_config_is_frozen_and_refuses_bad_values() -> None:
    cfg = EngineConfig(dispatch="naive")
    assert cfg.overlap is False and cfg.large_slots == cfg.num_slots
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_slots = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tokenizer = object()  # type: ignore[misc]
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"dispatch": "fast"}, ValueError, "dispatch must be one of"),
        ({"mode": "async"}, ValueError, "mode must be"),
        ({"mode": "threaded", "dispatch": "naive"}, ValueError, "mode='threaded' needs"),
        ({"overlap": True, "dispatch": "naive"}, ValueError, "overlap=True needs"),
        ({"overlap": 1}, TypeError, "overlap must be a bool"),
        ({"clock": "wall"}, ValueError, "clock must be one of"),
        ({"topology": "three"}, ValueError, "topology must be one of"),
        ({"host_charge": "all"}, ValueError, "host_charge must be one of"),
        ({"large_step_cost": 0}, ValueError, "large_step_cost must be a positive"),
        ({"large_step_cost": float("inf")}, ValueError, "large_step_cost must be finite"),
        ({"scheduler": object()}, TypeError, "scheduler must be a SchedulerConfig"),
        ({"num_slots": 0}, ValueError, "num_slots must be a positive int"),
        ({"large_num_slots": True}, ValueError, "large_num_slots must be a positive int"),
        ({"page_size": 1.5}, ValueError, "page_size must be a positive int"),
        ({"tokenizer": object()}, TypeError, "tokenizer must have a decode method"),
        ({"small_device": 0}, TypeError, "small_device must be a device name"),
        ({"large_device": "no-such-device"}, ValueError, "large_device"),
        ({"configure": "pad"}, TypeError, "configure must be callable"),
        ({"configure": print}, ValueError, "large_tp_devices and configure go with large_tp"),
        ({"large_tp_devices": ["cpu"]}, ValueError, "go with large_tp"),
        ({"large_tp": 0}, ValueError, "large_tp must be a positive int"),
        ({"large_tp": 2, "large_device": "cpu"}, ValueError, "large_tp_devices, not large_device"),
        ({"large_tp": 2, "large_tp_devices": ["cpu"]}, ValueError, "needs 2 devices"),
        ({"large_tp": 2, "large_tp_devices": "cpu"}, TypeError, "large_tp_devices must be"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            EngineConfig(**kwargs)


def test_devices_and_tp_devices_are_normalised() -> None:
    cfg = EngineConfig(small_device="cpu", large_tp=2, large_tp_devices=["cpu", "cpu"])
    assert cfg.small_device == torch.device("cpu") and cfg.large_device is None
    assert cfg.large_tp_devices == ("cpu", "cpu")


def test_a_misspelt_option_is_refused(pair: tuple[Any, Any]) -> None:
    with pytest.raises(TypeError, match="num_slot"):
        EngineConfig(num_slot=64)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="num_slots"):
        RoutedEngine(*pair, BernoulliRouter(0.3), num_slots=64)  # type: ignore[call-arg]


def test_config_must_be_an_engine_config(pair: tuple[Any, Any]) -> None:
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        RoutedEngine(*pair, BernoulliRouter(0.3), config={"num_slots": 64})  # type: ignore[arg-type]
