"""A prepared forward's KV slots are committed or given back exactly once."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from routing_helpers import check_idle, make_prompts

from tokencache_routing import EngineConfig, EntropyRouter, RoutedEngine
from tokencache_routing.core.state import SMALL


def test_a_forward_commits_once(pair: Any) -> None:
    """A second commit is refused (its rows' slots would be appended twice), and a discard
    after the commit gives nothing back (the slots are its requests' now). Ending its requests
    then releases everything."""
    eng = RoutedEngine(
        *pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=256, overlap=False)
    )
    eng.submit(make_prompts(1, seed=91)[0], 4)
    eng.intake()
    eng.sched.admit()
    prep = eng.sched.schedule_small()
    assert prep is not None
    prep.run()
    prep.commit()
    pool = eng.sides[SMALL].pool
    free = pool.available
    with pytest.raises(RuntimeError, match="already committed"):
        prep.commit()
    prep.discard()
    assert pool.available == free
    eng.sched.abandon(prep, RuntimeError("ended by the test"))
    check_idle(eng)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_tree_holds_the_tokens_that_were_fed(pair: Any, overlap: bool) -> None:
    """With overlap a step's input tokens are placeholders on the host until the step they
    continue is finished (drawn on the device): its commit writes the drawn ids into the tree,
    so a finished request's whole sequence (but its last token, never fed) is cached under
    its own tokens, exactly as without overlap."""
    prompts = make_prompts(3, seed=92, lo=6, hi=12)
    eng = RoutedEngine(
        *pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=512, overlap=overlap)
    )
    handles = [eng.submit(p, 12) for p in prompts]
    assert all(h.wait(60) for h in handles)
    side = eng.sides[SMALL]
    for p, h in zip(prompts, handles, strict=True):
        seq = np.array(p + h.tokens, np.int64)
        assert side.cached_prefix_len(seq) == len(seq) - 1
    eng.shutdown()
    check_idle(eng)


def test_a_step_failing_after_its_commit_fails_its_requests_only(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overlap: a step that continued the one before it is committed, and then reading its
    router's answers raises. Its live requests end with that error (abandoning a committed
    step must not trip over the link to the step it continued), and nothing is left pinned
    or allocated."""
    from tokencache_routing import BernoulliRouter
    from tokencache_routing.core.sampling import Decisions

    calls, resolve = [0], Decisions.resolve

    def flaky(self: Decisions) -> list[bool]:
        calls[0] += 1
        if calls[0] == 6:  # a steady step, continuing the one before it
            raise RuntimeError("answers lost")
        return resolve(self)

    monkeypatch.setattr(Decisions, "resolve", flaky)
    eng = RoutedEngine(*pair, BernoulliRouter(0.2, seed=9), config=EngineConfig(num_slots=512))
    handles = [eng.submit(p, 10) for p in make_prompts(3, seed=93, shared=4)]
    assert all(h.wait(60) for h in handles)
    failed = [h for h in handles if h.finished_reason == "error"]
    assert failed and all("answers lost" in repr(h.error) for h in failed)
    eng.shutdown()
    check_idle(eng)
