"""Finding a batch's shared slot-list prefix (the host side of shared-prefix attention).

The kernels themselves are checked under the Triton interpreter (test_triton_interpret.py);
here the pure host functions against a deliberately naive reference, and the context plumbing.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencache_models import ForwardBatch
from tokencache_models.context import (
    ForwardContext,
    HostBatch,
    shared_prefix_len,
    shared_prefix_passes,
    shared_prefix_pays,
)


def naive_shared_prefix(rows: list[list[int]], q_lens: list[int], min_len: int) -> int:
    """Position by position: the longest prefix every row has, before any row's new tokens."""
    if len(rows) < 2:
        return 0
    cap = min(len(r) - q for r, q in zip(rows, q_lens, strict=True))
    p = 0
    while p < cap and all(r[p] == rows[0][p] for r in rows):
        p += 1
    return p if p >= min_len else 0


@st.composite
def slot_lists(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    n = draw(st.integers(1, 6))
    base = draw(st.lists(st.integers(0, 9), min_size=0, max_size=40))
    rows, q_lens = [], []
    for _ in range(n):
        keep = draw(st.integers(0, len(base)))
        own = draw(st.lists(st.integers(0, 9), min_size=1, max_size=8))
        rows.append(base[:keep] + own)  # small alphabet: rows may agree past `keep` by chance
        q_lens.append(draw(st.integers(1, len(rows[-1]))))
    return rows, q_lens


@settings(max_examples=300, deadline=None)
@given(slot_lists(), st.integers(1, 12))
def test_shared_prefix_len_matches_naive(
    case: tuple[list[list[int]], list[int]], min_len: int
) -> None:
    rows, q_lens = case
    kv_off = np.concatenate(([0], np.cumsum([len(r) for r in rows]))).astype(np.int64)
    q_off = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    slots = np.array([s for r in rows for s in r], dtype=np.int64)
    got = shared_prefix_len(slots, kv_off, q_off, min_len=min_len)
    assert got == naive_shared_prefix(rows, q_lens, min_len)
    # Only the first num_real rows count (decode padding rows come after them).
    real = max(1, len(rows) - 1)
    assert shared_prefix_len(slots, kv_off, q_off, real, min_len) == naive_shared_prefix(
        rows[:real], q_lens[:real], min_len
    )


def test_passes_and_when_the_prefix_kernel_pays() -> None:
    # 128 query rows per program: 64 tokens of a group of 2, 32 of a group of 4 (or 3).
    assert [shared_prefix_passes(t, 2) for t in (1, 64, 65, 128)] == [1, 1, 2, 2]
    assert [shared_prefix_passes(t, 4) for t in (32, 33, 100)] == [1, 2, 4]
    assert shared_prefix_passes(5, 3) == shared_prefix_passes(5, 4)
    assert all(shared_prefix_pays(b, b, g) for b in range(2, 257) for g in (1, 2, 4, 8))
    assert not shared_prefix_pays(1, 1, 2)  # one row: nothing to share
    assert shared_prefix_pays(10, 100, 4)  # catch-up of 10 x 10: 4 passes
    assert not shared_prefix_pays(2, 600, 2)  # prefill of 2 x 300: 10 passes


def test_context_carries_the_prefix_to_the_device() -> None:
    common = torch.arange(100)
    own = [torch.arange(200 + 10 * i, 205 + 10 * i) for i in range(3)]
    new = [torch.tensor([400 + i]) for i in range(3)]
    decode = ForwardBatch.from_requests([[1]] * 3, [torch.cat((common, o)) for o in own], new)
    ctx = ForwardContext.build(decode, torch.device("cpu"), 999, shared_prefix_group=2)
    assert ctx.shared_len == 100 and ctx.prefix_len is not None
    assert ctx.prefix_len.tolist() == [100]
    assert ForwardContext.build(decode, torch.device("cpu"), 999).shared_len == 0  # off
    padded = HostBatch.from_batch(decode).padded(8, 999)  # padding rows do not count
    assert padded.shared_prefix(2) == 100
    # Two long prefills over the prefix: reading it per row is cheaper than 10 passes.
    prefill = ForwardBatch.from_requests(
        [[1] * 300] * 2,
        [common, common],
        [torch.arange(1000, 1300), torch.arange(2000, 2300)],
    )
    assert HostBatch.from_batch(prefill).shared_prefix_len() == 100
    assert ForwardContext.build(prefill, torch.device("cpu"), 999, None, None, 2).shared_len == 0
