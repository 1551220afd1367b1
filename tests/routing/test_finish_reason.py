"""How a request ends when its last allowed token is also a stop token: "stop", not "length"
(OpenAI's rule: a matched stop wins), whichever model writes that token (the small model's
tokens end in Scheduler.finish_small, the large model's in commit_token), in both drivers,
greedy and sampled, for stop_token_ids and for the engine's eos."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from routing_helpers import check_idle, make_prompts

from tokencache_routing import EngineConfig, RoutedEngine, SamplingParams, ScriptedRouter
from tokencache_routing.core.forward_finishing import end_reasons
from tokencache_routing.core.state import GREEDY, LARGE, SMALL, Request

N = 5  # max_new_tokens: the stop token is the N-th generated token


def test_the_rule_a_stop_on_the_last_allowed_token_wins() -> None:
    """end_reasons on its own: tokens [70, 13] after a 3-token prompt, 13 a stop token,
    max_new_tokens 2."""
    r = Request(0, 0, np.array([1, 2, 3]), 2, GREEDY, frozenset({13}))
    assert end_reasons([r], [70]) == [None]
    assert end_reasons([r], [13]) == ["stop"]  # a stop before the length
    r.n += 1  # 70 appended: the next token is the last one allowed
    assert end_reasons([r, r], [13, 70]) == ["stop", "length"]


def router_for(writer: int) -> ScriptedRouter:
    """The large model writes token N-1 (writer LARGE), or only token N-2, so that the small
    model writes the last one right after a hand-back (writer SMALL)."""
    return ScriptedRouter(default=[N - 1] if writer == LARGE else [N - 2])


def run(
    pair: Any,
    writer: int,
    mode: str,
    prompt: list[int],
    sampling: SamplingParams | None,
    stop_token_ids: tuple[int, ...] = (),
    eos: int | None = None,
) -> Any:
    eng = RoutedEngine(
        *pair, router_for(writer), config=EngineConfig(num_slots=256, mode=mode, eos_token_id=eos)
    )
    h = eng.submit(prompt, N, sampling=sampling, stop_token_ids=stop_token_ids)
    assert h.wait(60), "the request did not end"
    eng.shutdown()
    check_idle(eng)
    return h


@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["stop_token_ids", "eos"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("writer", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("mode", ["events", "threaded"])
def test_a_stop_token_that_reaches_max_new_tokens_ends_with_stop(
    pair: Any, mode: str, writer: int, sampled: bool, via: str
) -> None:
    """A free run gives N tokens, ending "length"; the same request with its N-th token as a
    stop (or eos) token gives the same N tokens, the N-th from `writer`, and ends "stop"."""
    sampling = SamplingParams(temperature=1.0, seed=7) if sampled else None
    for prompt in make_prompts(8, seed=90):
        free = run(pair, writer, mode, prompt, sampling)
        assert free.finished_reason == "length" and len(free.tokens) == N
        last = free.tokens[-1]
        if last not in free.tokens[:-1]:  # a token that first occurs last
            break
    else:
        raise AssertionError("no prompt whose last token first occurs there")
    assert free.models[-1] == writer and free.models[N - 2] == 1 - writer  # both models wrote
    stops = {"stop_token_ids": (last,), "eos": ()}[via]
    eos = last if via == "eos" else None
    h = run(pair, writer, mode, prompt, sampling, stop_token_ids=stops, eos=eos)
    assert h.tokens == free.tokens and h.models == free.models
    assert h.finished_reason == "stop"
