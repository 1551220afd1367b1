"""Shared helpers of the routing tests (a unique module name: tests/*/conftest.py collide).
Test modules import these from here, never from one another."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokencache_routing import Router

if TYPE_CHECKING:
    from tokencache_routing import BernoulliRouter, RoutedEngine

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96


def tiny_config(layers: int) -> Any:
    from tokencache_models import ModelConfig

    # Untied head and a wide init: varied greedy outputs with clear argmax margins.
    return ModelConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )


def make_prompts(n: int, seed: int, shared: int = 0, lo: int = 2, hi: int = 10) -> list[list[int]]:
    """n prompts; with shared > 0 they all start with the same `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (shared,), generator=g).tolist()
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(base + torch.randint(0, VOCAB, (k,), generator=g).tolist())
    return out


def bernoulli_decide(router: BernoulliRouter) -> Any:
    """The reference's decide(rid, pos) for a BernoulliRouter (its draws are a function of
    request and position)."""
    return lambda rid, pos: bool(router.decide(np.array([rid]), np.array([pos]))[0])


def check(
    pair: Any,
    router: Any,
    decide: Any,
    prompts: list[list[int]],
    max_new: int,
    **kw: Any,
) -> Any:
    """A fresh engine's generate equals the no-cache reference, and leaves it idle and clean."""
    from tokencache_routing import EngineConfig, RoutedEngine, reference_generate

    small, large = pair
    eng = RoutedEngine(small, large, router, config=EngineConfig(**kw))
    res = eng.generate(prompts, max_new)
    ref_tokens, ref_models = reference_generate(small, large, prompts, max_new, decide)
    assert res.tokens == ref_tokens
    assert res.models == ref_models
    assert eng.idle_invariant()
    for side in eng.sides:
        assert side.tree.protected_size() == 0
        side.tree.check_invariants()
    return eng, res


def no_worker_threads() -> bool:
    return not any(t.name.startswith("tokencache-") for t in threading.enumerate())


def check_idle(eng: RoutedEngine) -> None:
    """Every slot free or cached, nothing pinned, caches consistent, no worker left."""
    assert eng.idle_invariant()
    for side in eng.sides:
        assert side.pool.available + side.cached_size() == side.pool.num_slots
        assert side.pinned_size() == 0
        side.check_invariants()
    assert no_worker_threads()


# ---------------------------------------------------------------- fault injection


def check_exact(eng: RoutedEngine, pair: Any, router: BernoulliRouter, n: int = 3) -> None:
    """The engine's next generate is exact and leaves it idle (after a failure)."""
    from tokencache_routing import reference_generate

    prompts = make_prompts(n, seed=77, shared=4)
    res = eng.generate(prompts, 6)
    ref, _ = reference_generate(*pair, prompts, 6, bernoulli_decide(router))
    assert res.tokens == ref
    check_idle(eng)


class Flaky:
    """Raises `error` on calls for which `when(call_index)` is true."""

    def __init__(self, fn: Callable[..., Any], when: Callable[[int], bool], error: Any) -> None:
        self.fn, self.when, self.error, self.calls = fn, when, error, 0

    def __call__(self, *a: Any, **k: Any) -> Any:
        i = self.calls
        self.calls += 1
        if self.when(i):
            raise self.error
        return self.fn(*a, **k)


class FlakyModel:
    """A CausalLM whose forward (its device work, execute) fails at chosen calls (everything
    else delegated)."""

    def __init__(self, model: Any, when: Callable[[int], bool], error: Any) -> None:
        self._model = model
        self._call = Flaky(model.execute, when, error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._model(*a, **k)

    def execute(self, *a: Any, **k: Any) -> Any:
        return self._call(*a, **k)


class FlakyRouter(Router):
    def __init__(self, inner: Router, when: Callable[[int], bool], error: Any) -> None:
        self.inner = inner
        self.call = Flaky(inner.route, when, error)

    def route(self, f: Any) -> Any:
        return self.call(f)
