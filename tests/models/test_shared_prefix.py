"""Finding a batch's shared slot-list prefix (the host side of shared-prefix attention).

The kernels themselves are checked under the Triton interpreter (test_triton_interpret.py);
here the pure host functions against a deliberately naive reference, and the context plumbing.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokencache_models import PRESETS, ForwardBatch, PrefixShape
from tokencache_models.context import ForwardContext, HostBatch, shared_prefix_len

QWEN3_06B = PrefixShape.of(PRESETS["qwen3-0.6b"])  # GQA group 2, 8 kv heads, head_dim 128
QWEN3_8B = PrefixShape.of(PRESETS["qwen3-8b"])  # group 4


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
    """Rows on one base list, each keeping a long part of it (often all), then own slots; few
    new tokens, so that most cases have a prefix to find and rows diverge inside it."""
    n = draw(st.integers(2, 6))
    base = draw(st.lists(st.integers(0, 9), min_size=0, max_size=40))
    rows, q_lens = [], []
    for _ in range(n):
        keep = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        own = draw(st.lists(st.integers(0, 9), min_size=1, max_size=8))
        rows.append(base[:keep] + own)  # small alphabet: rows may agree past `keep` by chance
        q_lens.append(draw(st.integers(1, min(2, len(rows[-1])))))
    return rows, q_lens


@settings(max_examples=300, deadline=None)
@given(slot_lists(), st.integers(1, 12))
# Rows that diverge at 5, then at 3 inside the prefix: P must shrink to 3, not drop to 0.
@example(([[1] * 12 + [7], [1] * 5 + [2] * 8, [1] * 3 + [3] * 10], [1, 1, 1]), 2)
@example(([[1] * 12 + [7], [1] * 5 + [2] * 8, [1] * 3 + [3] * 10], [1, 1, 1]), 4)
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


def test_tiles_passes_splits_and_partials() -> None:
    # 128 query rows per program for bf16: 64 tokens of a group of 2, 32 of a group of 4 (or
    # 3); fp32 caches take 32-row tiles (16 tokens of a group of 2).
    assert [QWEN3_06B.passes(t) for t in (1, 64, 65, 128)] == [1, 1, 2, 2]
    assert [QWEN3_8B.passes(t) for t in (32, 33, 100)] == [1, 2, 4]
    assert PrefixShape(3, 8, 128).passes(40) == QWEN3_8B.passes(40)
    assert PrefixShape(2, 8, 128, itemsize=4).passes(17) == 2
    # Splits fill one wave of 132 SMs over (passes x kv heads) programs, at most 32; a known
    # prefix keeps each split >= 4 blocks of 64 slots.
    assert QWEN3_8B.splits(32) == 17 and QWEN3_8B.splits(1) == 17
    assert QWEN3_8B.splits(32, prefix_len=1000) == 3
    assert PrefixShape(8, 1, 64).splits(1) == 32
    # Partials: fp32 (acc + max + sum) per token, query head and split, written and read back,
    # in KV slots of 2 x kv_heads x head_dim x 2 bytes.
    want = -(-2 * 32 * 32 * 17 * 130 * 4 // (2 * 8 * 128 * 2))
    assert QWEN3_8B.overhead_slots(32) == want == 4420


def test_when_the_prefix_kernel_pays() -> None:
    for shape in (QWEN3_06B, QWEN3_8B):
        # Decode over a long prefix: always, from two rows on.
        assert all(shape.pays(b, b, 8000, decode=True) for b in range(2, 257))
        assert not shape.pays(1, 1, 8000, decode=True)  # one row: nothing to share
        assert not shape.pays(32, 32, 63, decode=True)  # under MIN_SHARED_PREFIX
    # Short prefixes: the partials cost more than the rows' reads save (8B, 32 rows: P * 31
    # slots saved against 4420 of partials).
    assert not QWEN3_8B.pays(32, 32, 140, decode=True)
    assert QWEN3_8B.pays(32, 32, 150, decode=True)
    assert QWEN3_8B.pays(10, 100, 2000, decode=False)  # catch-up of 10 x 10: 4 passes
    assert not QWEN3_06B.pays(2, 600, 2000, decode=False)  # prefill of 2 x 300: 10 passes


def test_context_carries_the_prefix_to_the_device() -> None:
    common = torch.arange(300)
    own = [torch.arange(400 + 10 * i, 405 + 10 * i) for i in range(8)]
    new = [torch.tensor([600 + i]) for i in range(8)]
    decode = ForwardBatch.from_requests([[1]] * 8, [torch.cat((common, o)) for o in own], new)
    tiny = PrefixShape(1, 1, 64)  # one query head: partials of 8 rows are 528 slots
    ctx = ForwardContext.build(decode, torch.device("cpu"), 999, shared_prefix=tiny)
    assert ctx.shared_len == 300 and ctx.prefix_len is not None
    assert ctx.prefix_len.tolist() == [300]
    assert ForwardContext.build(decode, torch.device("cpu"), 999).shared_len == 0  # off
    hb = HostBatch.from_batch(decode)
    padded = hb.padded(16, 999)  # padding rows share nothing, but the kernel runs them
    assert padded.shared_prefix(tiny) == 300
    assert tiny.overhead_slots(16) == 2 * tiny.overhead_slots(8)
    # The 8B shape: 300 + 1105 slots of partials < 8 x 300; at a 100-slot prefix, not.
    assert hb.shared_prefix(QWEN3_8B) == 300
    short = ForwardBatch.from_requests([[1]] * 8, [torch.cat((common[:100], o)) for o in own], new)
    assert HostBatch.from_batch(short).shared_prefix_len() == 100
    assert HostBatch.from_batch(short).shared_prefix(QWEN3_8B) == 0
    # Two long prefills over the prefix: reading it per row is cheaper than 5 passes.
    prefill = ForwardBatch.from_requests(
        [[1] * 300] * 2,
        [common, common],
        [torch.arange(1000, 1300), torch.arange(2000, 2300)],
    )
    assert HostBatch.from_batch(prefill).shared_prefix_len() == 300
    assert ForwardContext.build(prefill, torch.device("cpu"), 999, None, None, tiny).shared_len == 0
