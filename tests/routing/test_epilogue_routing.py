"""The small model's forward computes its greedy tokens, the entropy router's feature and its
answer in its epilogue (device work, tokencache_models.Epilogue): every token and every
escalation is the same as when the host computes them after the forward, on both drivers,
overlap on and off."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from routing_helpers import check_idle, make_prompts

from tokencache_models import Epilogue
from tokencache_routing import (
    EngineConfig,
    EntropyRouter,
    RoutedEngine,
    SamplingParams,
    SchedulerConfig,
)
from tokencache_routing.core.kv import ModelSide
from tokencache_routing.core.routers import RouterFeatures

SAMPLING = [None, SamplingParams(0.9, seed=5), None, SamplingParams(1.2, 0.8, seed=6)]


def _generate(pair: Any, mode: str, overlap: bool) -> tuple[RoutedEngine, list[Any]]:
    prompts = make_prompts(8, seed=81, shared=7, lo=2, hi=6)
    eng = RoutedEngine(
        *pair,
        EntropyRouter(3.5),
        config=EngineConfig(
            num_slots=1024,
            mode=mode,
            overlap=overlap,
            scheduler=SchedulerConfig(max_running=5, min_large_batch=2, max_wait_steps=2),
        ),
    )
    handles = [eng.submit(p, 12, sampling=SAMPLING[i % 4]) for i, p in enumerate(prompts)]
    assert all(h.wait(120) for h in handles)
    eng.shutdown()
    check_idle(eng)
    return eng, handles


@pytest.mark.parametrize("mode,overlap", [("events", True), ("events", False), ("threaded", True)])
def test_the_epilogue_changes_no_token_and_no_decision(
    pair: Any, monkeypatch: pytest.MonkeyPatch, mode: str, overlap: bool
) -> None:
    applied: list[Epilogue] = []
    apply = Epilogue.apply

    def spy(self: Epilogue, out: Any) -> Any:
        applied.append(self)
        return apply(self, out)

    def no_host_log_probs(self: RouterFeatures) -> torch.Tensor:
        raise AssertionError("the router computed on the host what the epilogue had")

    def no_host_route(self: EntropyRouter, f: RouterFeatures) -> torch.Tensor:
        raise AssertionError("the router answered on the host what the epilogue had")

    monkeypatch.setattr(Epilogue, "apply", spy)
    monkeypatch.setattr(RouterFeatures, "log_probs", property(no_host_log_probs))
    monkeypatch.setattr(EntropyRouter, "route", no_host_route)
    on, with_epilogue = _generate(pair, mode, overlap)
    monkeypatch.undo()
    # The small model's launched steps computed the entropy and the router's answer on the
    # device, the large one's not.
    assert any(e.entropy for e in applied) and not all(e.entropy for e in applied)
    assert all(e.escalate_at == 3.5 for e in applied if e.entropy)
    assert all(e.vocab == on.vocab_size for e in applied)

    applied.clear()  # the host computes greedy tokens and entropy after each forward
    monkeypatch.setattr(Epilogue, "apply", spy)
    monkeypatch.setattr(ModelSide, "epilogue", lambda self, router=None: None)
    off, on_the_host = _generate(pair, mode, overlap)
    assert not applied
    for a, b in zip(with_epilogue, on_the_host, strict=True):
        assert (a.tokens, a.models, a.finished_reason) == (b.tokens, b.models, b.finished_reason)
    assert on.stats.escalations == off.stats.escalations > 0  # the router really decided


def test_only_a_router_whose_answer_is_the_threshold_is_answered_on_the_device(pair: Any) -> None:
    """An EntropyRouter's answer is the epilogue's (escalate_at); a subclass that routes
    otherwise gets the entropy computed but answers itself, and so does any other router."""

    class Later(EntropyRouter):  # escalates only after the tenth generated token
        def route(self, f: RouterFeatures) -> torch.Tensor:
            return (f.entropy >= self.threshold) & (f.positions >= 10)

    eng = RoutedEngine(*pair, EntropyRouter(2.0), config=EngineConfig(num_slots=256))
    side = eng.sched.sides[0]
    assert side.epilogue(EntropyRouter(2.0)) == Epilogue(eng.vocab_size, True, 2.0)
    assert side.epilogue(Later(2.0)) == Epilogue(eng.vocab_size, True, None)
    assert side.epilogue(None) == Epilogue(eng.vocab_size, False, None)
    import numpy as np

    assert side.epilogue(EntropyRouter(np.float64(2.0))) == Epilogue(eng.vocab_size, True, 2.0)  # type: ignore[arg-type]
    for odd in (float("nan"), torch.tensor(2.0), True):  # never a graph key: the host answers
        assert side.epilogue(EntropyRouter(odd)) == Epilogue(eng.vocab_size, True, None)  # type: ignore[arg-type]
    prompts = make_prompts(6, seed=3, shared=4, lo=2, hi=5)
    asked: list[int] = []
    route = Later.route

    def counted(self: Later, f: RouterFeatures) -> torch.Tensor:
        asked.append(len(f.tokens))
        return route(self, f)

    Later.route = counted  # type: ignore[method-assign]
    try:
        out = RoutedEngine(*pair, Later(0.0), config=EngineConfig(num_slots=1024)).generate(
            prompts, 14
        )
    finally:
        Later.route = route  # type: ignore[method-assign]
    assert asked  # its own route answered
    # And what it answered was done: nothing escalated before the tenth token, every token
    # from there (entropy >= 0 always) by the large model.
    assert all(models[:10] == [0] * 10 and set(models[10:]) == {1} for models in out.models)
    eng.shutdown()
