"""`tokencache serve --chunked-prefill-size N --large-chunked-prefill-size N`: the budgets reach
the engine's SchedulerConfig (the real engine that build_app makes, not a mock), and a served
request whose prompt and catch-ups a small budget splits answers with exactly the tokens the
same server writes with no budget (greedy, the tiny models)."""

from __future__ import annotations

from typing import Any

import pytest
from serve_helpers import post_json

from tokencache_routing import SchedulerConfig
from tokencache_serve import DEFAULT_MODEL_NAME
from tokencache_serve.cli import build_app, build_parser
from tokencache_serve.runner import BackgroundServer

ARGS = ["serve", "--large", "tiny", "--router", "entropy:3.4", "--max-running", "4"]
DEFAULT = SchedulerConfig().chunked_prefill_size  # the engine's default budget (2048)


def app_with(*flags: str) -> Any:
    return build_app(build_parser().parse_args([*ARGS, "--num-slots", "2048", *flags]))


@pytest.mark.parametrize(
    ("flags", "small", "large", "budgets"),
    [
        ((), DEFAULT, None, (DEFAULT, DEFAULT)),
        (("--chunked-prefill-size", "16"), 16, None, (16, 16)),
        (("--chunked-prefill-size", "0"), 0, None, (0, 0)),
        (("--large-chunked-prefill-size", "256"), DEFAULT, 256, (DEFAULT, 256)),
        (("--chunked-prefill-size=64", "--large-chunked-prefill-size=0"), 64, 0, (64, 0)),
    ],
)
def test_flags_reach_the_engines_scheduler_config(
    flags: tuple[str, ...], small: int, large: int | None, budgets: tuple[int, int]
) -> None:
    eng = app_with(*flags).state.server.engine
    cfg = eng.sched_config
    assert isinstance(cfg, SchedulerConfig)
    assert (cfg.chunked_prefill_size, cfg.large_chunked_prefill_size) == (small, large)
    assert (cfg.token_budget(0), cfg.token_budget(1)) == budgets  # small step, catch-up
    assert cfg.max_running == 4  # the other scheduler options still arrive beside them


PROMPTS = [
    [5 + (7 * i) % 88 for i in range(100)],  # 100 tokens: 7 chunks of 16
    [5 + (7 * i) % 88 for i in range(20)] + [9 + (5 * i) % 80 for i in range(37)],  # shares 20
    [11, 12, 13],  # shorter than a chunk
]


def served_tokens(*flags: str) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(token ids, large-token mask) of each prompt (24 new tokens at most: <eos> may end one
    sooner), greedy, one after the other; and how many rows of the engine's forwards stopped
    short of their end (chunked)."""
    app = app_with(*flags)
    out = []
    with BackgroundServer(app) as srv:
        for prompt in PROMPTS:
            body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 24,
                    "temperature": 0}  # fmt: skip
            status, got = post_json(srv.url, "/v1/completions", body)
            assert status == 200, got
            assert got["usage"]["prompt_tokens"] == len(prompt)
            x = got["choices"][0]["tokencache"]
            out.append((x["token_ids"], x["large_token_mask"]))
    return out, app.state.server.engine.stats.prefill_chunks


def test_small_budget_splits_and_answers_as_without_one() -> None:
    off, off_chunks = served_tokens("--chunked-prefill-size", "0")
    split, split_chunks = served_tokens("--chunked-prefill-size", "16")
    assert off_chunks == 0
    assert split_chunks >= 6  # the 100-token prompt alone takes 7 forwards of 16 on each model
    assert split == off
    assert sum(len(tokens) for tokens, _ in off) > 48  # not all cut short by <eos>
    assert any(any(mask) for _, mask in off)  # the large model wrote some: catch-ups ran
    # catch-ups alone in small chunks, the small model without a budget: the same again
    large_only, large_chunks = served_tokens(
        "--chunked-prefill-size", "0", "--large-chunked-prefill-size", "16"
    )
    assert large_chunks > 0
    assert large_only == off
