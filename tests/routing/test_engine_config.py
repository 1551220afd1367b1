"""EngineConfig: RoutedEngine's options as one frozen, validated value; the keyword
constructor builds the same one, and both engines generate the same tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from routing_helpers import make_prompts

from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine, SchedulerConfig


def test_keywords_and_config_build_the_same_engine(pair: tuple[Any, Any]) -> None:
    small, large = pair
    sched = SchedulerConfig(max_running=4, max_parked=4)
    kw = RoutedEngine(
        small,
        large,
        BernoulliRouter(0.3, seed=1),
        num_slots=512,
        scheduler=sched,
        large_step_cost=2.0,
    )
    cfg = EngineConfig(num_slots=512, scheduler=sched, large_step_cost=2.0)
    by_config = RoutedEngine(small, large, BernoulliRouter(0.3, seed=1), config=cfg)
    assert kw.config == by_config.config == cfg
    assert cfg.overlap is True  # the tokencache dispatch's default, resolved
    prompts = make_prompts(6, seed=3)
    a = kw.generate(prompts, 8)
    b = by_config.generate(prompts, 8)
    assert a.tokens == b.tokens
    assert a.stats.steps == b.stats.steps


def test_config_is_frozen_and_refuses_bad_values() -> None:
    cfg = EngineConfig(dispatch="naive")
    assert cfg.overlap is False and cfg.large_slots == cfg.num_slots
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_slots = 3  # type: ignore[misc]
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
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            EngineConfig(**kwargs)


def test_config_and_keywords_not_both(pair: tuple[Any, Any]) -> None:
    small, large = pair
    with pytest.raises(TypeError, match="pass num_slots in config"):
        RoutedEngine(small, large, BernoulliRouter(0.3), num_slots=64, config=EngineConfig())
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        RoutedEngine(small, large, BernoulliRouter(0.3), config={"num_slots": 64})  # type: ignore[arg-type]
