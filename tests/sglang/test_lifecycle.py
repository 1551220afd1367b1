"""SGLang's own mem_cache helpers drive the backend through whole request lifecycles.

Admission with prefix hits, chunked prefill, decode hand-off checkpoints, finish, abort and
retraction under memory pressure; SGLang's RadixCache runs the same script, and both must
show the same prefix hits and pool accounting at every step and end with the scheduler's idle
check (available + evictable == pool size, nothing protected).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest


def run_script(sgl: SimpleNamespace, make_cache: Any, page_size: int, seed: int) -> list:
    from sgl_harness import corpus
    from sgl_lifecycle import MiniScheduler

    rng = np.random.default_rng(seed)
    sched = MiniScheduler(make_cache, page_size)
    # Long prompts (the page-16 corpus) at every page size, so the pool runs short.
    prompts = [s[:300] for s in corpus(seed, 16)]
    trace: list = []
    waiting: list = []
    for step in range(160):
        roll = rng.random()
        if roll < 0.5 and len(sched.running) < 12:
            prompt = prompts[int(rng.integers(len(prompts)))]
            extra_key = "lora" if rng.random() < 0.2 else None
            req = sched.admit(f"r{step}", prompt, int(rng.integers(1, 120)), extra_key)
            trace.append(("admit", None if req is None else req.prefix_len))
        elif roll < 0.6 and waiting:
            req = waiting.pop(0)
            trace.append(("readmit", sched.readmit(req), req.prefix_len))
        for req in list(sched.running):
            if sched.done(req):
                sched.finish(req)
            elif rng.random() < 0.02:
                sched.abort(req)
            elif rng.random() < 0.02 or not sched.step(req, rng, handoff=rng.random() < 0.3):
                # Retraction: at random, and whenever decode runs out of memory.
                sched.retract(req)
                waiting.append(req)
        trace.append(("sizes", *sched.idle_ok(), sched.cache.total_size()))
    while sched.running:
        sched.finish(sched.running[0])
    for req in waiting:  # never readmitted: nothing of theirs is held any more
        assert req.lock is None and not req.kv.holds_kv
    available_plus_evictable, protected, pool = sched.idle_ok()
    assert protected == 0
    assert available_plus_evictable == pool, "KV leak at idle"
    trace.append(("idle", available_plus_evictable, sched.retracted))
    return trace


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lifecycle_matches_radix_cache(
    sgl: SimpleNamespace, runtime: SimpleNamespace, page_size: int, seed: int
) -> None:
    ours = run_script(sgl, sgl.cache.TokenCacheRadixCache, page_size, seed)
    reference = run_script(sgl, sgl.RadixCache, page_size, seed)
    for i, (a, b) in enumerate(zip(reference, ours, strict=False)):
        assert a == b, f"event {i}: sglang {a} != tokencache {b}"
    assert len(reference) == len(ours)
    assert any(e[0] == "admit" and e[1] for e in ours), "the script never hit the cache"
