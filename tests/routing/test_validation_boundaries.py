"""The engine's own limits at their edges: exactly at a limit is accepted (and runs to its
end), one past it is refused with an error naming what is wrong. SamplingParams' ranges
(temperature, top_p, seed) and submit's lengths (max_new_tokens, the prompt, token ids, stop
ids, prompt + max_new_tokens against the KV pools and the context window)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from routing_helpers import VOCAB, bernoulli_decide, check_idle, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    SamplingParams,
    reference_generate,
)
from tokencache_routing.core.state import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE

TINY = 5e-324  # the least positive float


@pytest.mark.parametrize(
    "field,at,past",
    [
        ("temperature", MAX_TEMPERATURE, math.nextafter(MAX_TEMPERATURE, math.inf)),
        ("temperature", 0.0, -TINY),
        ("top_p", 1.0, math.nextafter(1.0, 2.0)),
        ("top_p", TINY, 0.0),
        ("seed", MAX_SEED, MAX_SEED + 1),
        ("seed", 0, -1),
    ],
)
def test_sampling_params_at_and_one_past_each_limit(field: str, at: Any, past: Any) -> None:
    assert getattr(SamplingParams(**{field: at}), field) == at
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: past})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_the_engine_samples_at_each_limit(pair: Any, mode: str) -> None:
    """Requests at the edges of SamplingParams' ranges run to their length in one batch; the
    narrowest nucleus (top_p = the least positive float, 0 in the sampler's float32) and the
    lowest temperature sampled keep only the most likely token: the greedy tokens."""
    router = BernoulliRouter(0.3, seed=31)
    prompts = make_prompts(5, seed=91)
    params = [
        SamplingParams(MAX_TEMPERATURE, seed=MAX_SEED),
        SamplingParams(1.0, TINY, seed=0),
        SamplingParams(MIN_TEMPERATURE, seed=1),
        SamplingParams(1.0, math.nextafter(1.0, 0.0), seed=2),
        SamplingParams(0.0, TINY),
    ]
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=512, mode=mode))
    handles = [eng.submit(p, 6, sampling=sp) for p, sp in zip(prompts, params, strict=True)]
    assert all(h.wait(60) for h in handles)
    assert [h.finished_reason for h in handles] == ["length"] * 5
    ref, _ = reference_generate(*pair, prompts, 6, bernoulli_decide(router))
    assert [h.tokens for h in handles[1:3]] == ref[1:3]
    assert handles[4].tokens == ref[4]
    eng.shutdown()
    check_idle(eng)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"max_new_tokens": -1}, ValueError, r"max_new_tokens must be >= 0, got -1"),
        ({"prompt": []}, ValueError, r"prompts must not be empty"),
        ({"prompt": [1, VOCAB]}, ValueError, rf"token id {VOCAB} is outside the vocabulary"),
        ({"prompt": [-1, 1]}, ValueError, r"token id -1 is outside the vocabulary"),
        ({"stop_token_ids": [VOCAB]}, ValueError, rf"token id {VOCAB} is outside the vocab"),
        ({"stop_token_ids": [-1]}, ValueError, r"token id -1 is outside the vocabulary"),
    ],
)
def test_submit_refuses_one_past_each_limit(
    pair: Any, kw: dict[str, Any], error: type, match: str
) -> None:
    eng = RoutedEngine(*pair, BernoulliRouter(0.3), config=EngineConfig(num_slots=256))
    with pytest.raises(error, match=match):
        eng.submit(kw.get("prompt", [1, 2]), kw.get("max_new_tokens", 2), **_only_stops(kw))
    assert eng.metrics()["requests_submitted"] == 0
    check_idle(eng)


def _only_stops(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k == "stop_token_ids"}


@pytest.mark.timeout(120)
def test_submit_accepts_each_limit_exactly(pair: Any) -> None:
    """One token of prompt, the first and last ids of the vocabulary in the prompt and as stop
    ids, max_new_tokens 0 (ends at once, "length", nothing generated)."""
    eng = RoutedEngine(*pair, BernoulliRouter(0.3, seed=32), config=EngineConfig(num_slots=256))
    none = eng.submit([VOCAB - 1, 0], 0)
    assert none.done() and none.finished_reason == "length" and none.tokens == []
    h = eng.submit([VOCAB - 1], 3, stop_token_ids=[VOCAB - 1, 0])
    g = eng.submit([0], 3)
    assert h.wait(60) and g.wait(60)
    assert len(h.tokens) == 3 or h.tokens[-1] in (0, VOCAB - 1)
    assert g.finished_reason == "length" and len(g.tokens) == 3
    check_idle(eng)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["events", "threaded"])
@pytest.mark.parametrize(
    "slots,large_slots,page_size",
    [(64, None, 1), (64, 40, 1), (40, 64, 4), (66, None, 4)],
)
def test_prompt_plus_max_new_tokens_at_the_kv_bound(
    pair: Any, mode: str, slots: int, large_slots: int | None, page_size: int
) -> None:
    """max_context = the smaller pool + 1 (the last token is never fed): two requests of
    exactly that many tokens, which the pools cannot hold at once, each run to their end
    (one waits for the other's KV) with the reference's tokens; one token more is refused."""
    kw: dict[str, Any] = {"page_size": page_size, "mode": mode}
    if large_slots is not None:
        kw["large_num_slots"] = large_slots
    router = BernoulliRouter(0.5, seed=33)
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=slots, **kw))
    limit = min(slots, large_slots or slots) + 1
    assert eng.max_context == limit
    prompts = [p[:1] * (limit - 5 - len(p)) + p for p in make_prompts(2, seed=92, lo=2, hi=4)]
    handles = [eng.submit(p, 5) for p in prompts]
    assert all(h.wait(60) for h in handles)
    ref, _ = reference_generate(*pair, prompts, 5, bernoulli_decide(router))
    assert [h.tokens for h in handles] == ref
    assert [h.finished_reason for h in handles] == ["length"] * 2
    with pytest.raises(ValueError, match=rf"can never fit: at most {limit}"):
        eng.submit(prompts[0], 6)
    with pytest.raises(ValueError, match="can never fit"):
        eng.submit([1] * (limit + 1), 0)
    eng.shutdown()
    check_idle(eng)


@pytest.mark.timeout(180)
def test_prompt_plus_max_new_tokens_at_the_context_window(pair: Any) -> None:
    """Pools larger than the models' positions (512): exactly 512 tokens run to the end,
    513 are refused."""
    eng = RoutedEngine(*pair, BernoulliRouter(0.3, seed=34), config=EngineConfig(num_slots=4096))
    limit = pair[0].config.max_position_embeddings
    assert eng.max_context == limit == 512
    prompt = (make_prompts(1, seed=93)[0] * limit)[: limit - 3]
    h = eng.submit(prompt, 3)
    assert h.wait(120) and h.finished_reason == "length" and len(h.tokens) == 3
    with pytest.raises(ValueError, match=rf"can never fit: at most {limit}"):
        eng.submit(prompt, 4)
    check_idle(eng)
