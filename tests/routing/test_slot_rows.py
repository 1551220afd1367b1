"""Per-request slot rows kept incrementally equal the cursor's own slot list at every step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from routing_helpers import bernoulli_decide, check, make_prompts

from tokencache_routing import BernoulliRouter
from tokencache_routing.core.kv import CursorKV
from tokencache_routing.core.scheduler_config import SchedulerConfig


@pytest.fixture
def checked_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wraps attach and commit_many (test only) to compare every row with cursor.slots()."""
    counts = [0, 0]  # rows checked, rows that had a duplicate patched in
    attach, commit = CursorKV.attach, CursorKV.commit_many

    def same(h: CursorKV) -> None:
        assert h.cursor is not None and h.length == h.cursor.length
        assert np.array_equal(h.slots(), h.cursor.slots())
        counts[0] += 1

    def attach_checked(self: CursorKV, seq: np.ndarray) -> None:
        attach(self, seq)
        same(self)

    def commit_checked(side: Any, handles: Any, offsets: Any, tokens: Any, slots: Any) -> None:
        commit(side, handles, offsets, tokens, slots)
        for i, h in enumerate(handles):
            mine = slots[offsets[i] : offsets[i + 1]]
            counts[1] += not np.array_equal(h.slots()[h.length - len(mine) :], mine)
            same(h)

    monkeypatch.setattr(CursorKV, "attach", attach_checked)
    monkeypatch.setattr(CursorKV, "commit_many", staticmethod(commit_checked))
    return counts


@pytest.mark.parametrize("num_slots", [1024, 60])
@pytest.mark.parametrize("page_size", [1, 4])
def test_rows_equal_cursor_slots(
    pair: Any, checked_rows: list[int], num_slots: int, page_size: int
) -> None:
    router = BernoulliRouter(0.3, seed=21)
    prompts = make_prompts(8, seed=21, shared=12, lo=2, hi=6)
    prompts += [prompts[0], prompts[3]]  # identical prompts: whole-prompt duplicates
    sched = SchedulerConfig(max_running=5, min_large_batch=2, max_wait_steps=2)
    kw = {"num_slots": num_slots, "scheduler": sched, "page_size": page_size}
    _, res = check(pair, router, bernoulli_decide(router), prompts, 12, **kw)
    checked, patched = checked_rows
    assert checked > 0
    if num_slots > 100:  # shared prefixes really came back as Dedup patches
        # (under memory pressure the only duplicates here were first catch-ups of one shared
        # prompt in one large batch, which the catch-up hold-back now avoids)
        assert patched > 0
    if num_slots < 100:
        assert res.stats.preemptions > 0
