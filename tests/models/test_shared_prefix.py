"""Finding a batch's shared slot-list prefixes (the host side of shared-prefix attention).

The kernels themselves are checked under the Triton interpreter (test_triton_interpret.py);
here the pure host functions against deliberately naive references, and the context plumbing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokencache_models import PRESETS, ForwardBatch, PrefixShape
from tokencache_models.forward.context import ForwardContext, HostBatch, shared_prefix_len
from tokencache_models.shared_prefix.groups import (
    TILE_FIELDS,
    PrefixGroup,
    find_prefix_groups,
    max_tiles,
    paying_groups,
    prefix_tables,
    prefix_traffic,
)

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


def one_group_pays(shape: PrefixShape, q_lens: list[int], prefix: int, decode: bool) -> bool:
    """Whether one group of all len(q_lens) rows on a prefix of `prefix` slots takes the path."""
    q_off = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    group = PrefixGroup(tuple(range(len(q_lens))), prefix)
    return paying_groups([group], q_off, shape, decode) == [group]


def test_when_the_prefix_kernel_pays() -> None:
    for shape in (QWEN3_06B, QWEN3_8B):
        # Decode over a long prefix: always, from two rows on.
        assert all(one_group_pays(shape, [1] * b, 8000, decode=True) for b in range(2, 257))
        assert not one_group_pays(shape, [1], 8000, decode=True)  # one row: nothing to share
        assert not one_group_pays(shape, [1] * 32, 63, decode=True)  # under MIN_SHARED_PREFIX
    # Short prefixes: the partials cost more than the rows' reads save (8B, 32 rows: P * 31
    # slots saved against 4420 of partials).
    assert not one_group_pays(QWEN3_8B, [1] * 32, 142, decode=True)
    assert one_group_pays(QWEN3_8B, [1] * 32, 143, decode=True)
    assert one_group_pays(QWEN3_8B, [10] * 10, 2000, decode=False)  # catch-up: 4 passes
    assert not one_group_pays(QWEN3_06B, [300] * 2, 2000, decode=False)  # prefill: 10 passes


def naive_common(a: list[int], b: list[int], limit: int) -> int:
    p = 0
    while p < limit and a[p] == b[p]:
        p += 1
    return p


@st.composite
def grouped_slot_lists(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Rows on a few prompts (some nested: a prompt extending another), or on none, then own
    slots; a small alphabet so rows also agree by chance."""
    prompts = [draw(st.lists(st.integers(0, 4), min_size=0, max_size=30)) for _ in range(3)]
    prompts.append(prompts[0] + draw(st.lists(st.integers(0, 4), min_size=1, max_size=20)))
    rows, q_lens = [], []
    for _ in range(draw(st.integers(1, 9))):
        base = draw(st.sampled_from([*prompts, []]))
        keep = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        own = draw(st.lists(st.integers(0, 4), min_size=1, max_size=6))
        rows.append(base[:keep] + own)
        q_lens.append(draw(st.integers(1, min(3, len(rows[-1])))))
    return rows, q_lens


def arrays(rows: list[list[int]], q_lens: list[int]) -> tuple[np.ndarray, ...]:
    kv_off = np.concatenate(([0], np.cumsum([len(r) for r in rows]))).astype(np.int64)
    q_off = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    return np.array([s for r in rows for s in r], dtype=np.int64), kv_off, q_off


@settings(max_examples=400, deadline=None)
@given(grouped_slot_lists(), st.integers(1, 8), st.integers(1, 4))
# An anchor on the outer prompt only: the rows on the nested one group without it.
@example(([[1] * 4 + [0], [1] * 9 + [2], [1] * 9 + [3], [1] * 9 + [4]], [1] * 4), 2, 8)
# Rows sharing a long prefix among many that share a short one with the anchor.
@example(([[5] * 3 + [0]] + [[5] * 2 + [i] for i in range(1, 7)] + [[5] * 8] * 2, [1] * 9), 2, 8)
def test_prefix_groups_hold_what_they_claim(
    case: tuple[list[list[int]], list[int]], min_len: int, max_groups: int
) -> None:
    """Against position-by-position checks: groups are disjoint sets of >= 2 real rows whose
    slot lists agree on [0, P) before any row's new tokens, P >= min_len, and P cannot grow;
    while fewer than max_groups were found, no two ungrouped rows share min_len slots."""
    rows, q_lens = case
    slots, kv_off, q_off = arrays(rows, q_lens)
    real = len(rows) - (len(rows) > 2)  # a padding row at the end when there are three or more
    groups = find_prefix_groups(slots, kv_off, q_off, real, min_len, max_groups)
    caps = [len(r) - q for r, q in zip(rows, q_lens, strict=True)]
    seen: set[int] = set()
    assert len(groups) <= max_groups
    assert [g.rows[0] for g in groups] == sorted(g.rows[0] for g in groups)
    for g in groups:
        assert len(g.rows) >= 2 and list(g.rows) == sorted(set(g.rows))
        assert not seen & set(g.rows) and max(g.rows) < real
        seen |= set(g.rows)
        p = g.length
        assert p >= min_len and all(p <= caps[r] for r in g.rows)
        anchor = rows[g.rows[0]]
        assert all(naive_common(anchor, rows[r], p) == p for r in g.rows)
        # Maximal: a row ends its prefix at P, or two rows differ there.
        assert any(caps[r] == p for r in g.rows) or len({rows[r][p] for r in g.rows}) > 1
    if len(groups) < max_groups:
        alone = [r for r in range(real) if r not in seen]
        for i, a in enumerate(alone):
            for b in alone[i + 1 :]:
                limit = min(caps[a], caps[b])
                assert naive_common(rows[a], rows[b], limit) < min_len, (a, b)


@settings(max_examples=200, deadline=None)
@given(slot_lists(), st.integers(1, 12))
def test_one_prompt_makes_one_group(case: tuple[list[list[int]], list[int]], min_len: int) -> None:
    """Rows that share exactly their common prefix (no two agree further) form one group of
    all rows with P = shared_prefix_len: the single system prompt case is unchanged."""
    rows, q_lens = case
    slots, kv_off, q_off = arrays(rows, q_lens)
    p = shared_prefix_len(slots, kv_off, q_off, min_len=min_len)
    caps = [len(r) - q for r, q in zip(rows, q_lens, strict=True)]
    further = {rows[i][p] for i in range(len(rows)) if caps[i] > p}
    if p == 0 or len(further) < sum(c > p for c in caps):
        return  # no prefix, or some rows agree past it (subgroups may then do better)
    assert find_prefix_groups(slots, kv_off, q_off, min_len=min_len) == [
        PrefixGroup(tuple(range(len(rows))), p)
    ]


def test_tile_table_covers_each_group_token_once() -> None:
    shape = PrefixShape(2, 8, 128)  # 64 tokens per tile
    q_off = np.concatenate(([0], np.cumsum([1] * 100 + [30, 50]))).astype(np.int64)
    kv_off = np.arange(len(q_off), dtype=np.int64) * 1000
    groups = [PrefixGroup(tuple(range(0, 100, 2)), 500), PrefixGroup((1, 100, 101), 300)]
    t = prefix_tables(groups, q_off, kv_off, shape)
    grouped = [*range(0, 100, 2), 1, *range(100, 180)]
    assert t.tokens.tolist() == grouped  # row 100's 30 tokens, then row 101's 50
    # Group 0: 50 tokens (one tile); group 1: 1 + 30 + 50 tokens (two tiles); the other 49
    # rows are in no tile (their own kernels write their prefix columns empty).
    assert t.tiles.tolist() == [[0, 50, 0, 500], [50, 64, 1000, 300], [114, 17, 1000, 300]]
    assert t.row_skip[:4].tolist() == [500, 300, 500, 0] and t.row_skip[100:].tolist() == [300] * 2
    assert t.longest == 500
    # A graph's table for two groups: padded with empty tiles, the tokens to every token.
    assert max_tiles(shape, 180, 2) == 3 + 1 and max_tiles(shape, 180, 1) == 3
    padded = prefix_tables(groups, q_off, kv_off, shape, max_tiles(shape, 180, 2))
    assert padded.num_tiles == 4 and padded.arrays()[1].size == 4 * TILE_FIELDS
    assert np.array_equal(padded.tiles[:3], t.tiles) and not padded.tiles[3:].any()
    assert padded.tokens.tolist() == grouped + [0] * (180 - len(grouped))
    with pytest.raises(ValueError, match="do not fit"):
        prefix_tables(groups, q_off, kv_off, shape, 2)
    assert prefix_tables([], q_off, kv_off, shape).num_tiles == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=2, max_size=40), st.integers(1, 8), st.data())
def test_max_tiles_bounds_every_grouping(q_lens: list[int], n: int, data: st.DataObject) -> None:
    """Any n disjoint groups of the rows fit max_tiles(shape, tokens, n) tiles (a graph's)."""
    shape = PrefixShape(2, 8, 128)
    q_off = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    order = data.draw(st.permutations(range(len(q_lens))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(q_lens) - 1), max_size=n - 1)))
    parts = [order[a:b] for a, b in itertools.pairwise([0, *cuts, len(q_lens)])]
    groups = [PrefixGroup(tuple(sorted(p)), 100) for p in parts if p]
    t = prefix_tables(groups, q_off, np.zeros_like(q_off), shape)
    assert t.num_tiles <= max_tiles(shape, int(q_off[-1]), len(groups))


def test_groups_pay_together_against_the_partials() -> None:
    """Every query token writes partials once any group takes the path, so groups pay as a
    whole: two rows on a long prefix in a batch of 32 do not cover 32 tokens' partials."""
    q_off = np.arange(33, dtype=np.int64)
    both = [PrefixGroup(tuple(range(16)), 3000), PrefixGroup(tuple(range(16, 32)), 2000)]
    assert paying_groups(both, q_off, QWEN3_8B, decode=True) == both
    skipped, read = prefix_traffic(both, q_off, QWEN3_8B, decode=True)
    assert skipped == 16 * 3000 + 16 * 2000
    assert read == 3000 + 2000 + QWEN3_8B.overhead_slots(32) == 5000 + 4420
    pair = [PrefixGroup((0, 1), 3000)]
    assert one_group_pays(QWEN3_8B, [1, 1], 3000, decode=True)  # alone in a batch of two
    assert paying_groups(pair, q_off, QWEN3_8B, decode=True) == []  # 3000 < 4420 of partials
    # A group whose tokens need as many tiles as it has rows never pays (a long prefill).
    prefill = np.array([0, 300, 600, 601], dtype=np.int64)
    long_rows = [PrefixGroup((0, 1), 5000), PrefixGroup((1, 2), 5000)]
    assert paying_groups(long_rows[:1], prefill, QWEN3_06B, decode=False) == []


def test_context_carries_the_groups_to_the_device() -> None:
    common, other = torch.arange(300), torch.arange(3000, 3250)
    own = [torch.arange(400 + 10 * i, 405 + 10 * i) for i in range(8)]
    new = [torch.tensor([600 + i]) for i in range(8)]
    prompts = [common if i % 2 == 0 else other for i in range(8)]
    pre = [torch.cat((p, o)) for p, o in zip(prompts, own, strict=True)]
    decode = ForwardBatch.from_requests([[1]] * 8, pre, new)
    tiny = PrefixShape(1, 1, 64)  # one query head: partials of 8 rows are 528 slots
    ctx = ForwardContext.build(decode, torch.device("cpu"), 999, shared_prefix=tiny)
    assert ctx.prefix is not None and ctx.prefix.groups is not None
    assert [(g.rows, g.length) for g in ctx.prefix.groups] == [
        ((0, 2, 4, 6), 300),
        ((1, 3, 5, 7), 250),
    ]
    assert ctx.prefix.skipped == 4 * 300 + 4 * 250 and ctx.prefix.longest == 300
    assert ctx.prefix.row_skip.tolist() == [300, 250] * 4
    t = prefix_tables(ctx.prefix.groups, HostBatch.from_batch(decode).q_offsets,
                      HostBatch.from_batch(decode).kv_starts, tiny)  # fmt: skip
    assert ctx.prefix.tiles.tolist() == t.tiles.reshape(-1).tolist()
    assert ctx.prefix.tokens.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert ForwardContext.build(decode, torch.device("cpu"), 999).prefix is None  # off
    hb = HostBatch.from_batch(decode)
    padded = hb.padded(16, 999)  # padding rows share nothing, but the kernel runs them
    assert [g.length for g in padded.prefix_groups(tiny)] == [300, 250]
    # The 8B shape: 550 + 1105 slots of partials < 2200 skipped; at 100-slot prefixes, not.
    assert len(hb.prefix_groups(QWEN3_8B)) == 2
    short = ForwardBatch.from_requests(
        [[1]] * 8, [torch.cat((p[:100], o)) for p, o in zip(prompts, own, strict=True)], new
    )
    assert len(find_prefix_groups(*arrays_of(short))) == 2
    assert HostBatch.from_batch(short).prefix_groups(QWEN3_8B) == []
    # Two long prefills over the prefix: reading it per row is cheaper than 5 passes.
    prefill = ForwardBatch.from_requests(
        [[1] * 300] * 2,
        [common, common],
        [torch.arange(1000, 1300), torch.arange(2000, 2300)],
    )
    assert HostBatch.from_batch(prefill).shared_prefix_len() == 300
    assert ForwardContext.build(prefill, torch.device("cpu"), 999, None, None, tiny).prefix is None


def arrays_of(batch: ForwardBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hb = HostBatch.from_batch(batch)
    return hb.kv_slots, np.concatenate(([0], np.cumsum(hb.kv_lens))), hb.q_offsets


def test_an_anchor_that_diverges_early_is_left_out() -> None:
    """The first row shares only the outer prompt: grouping the three on the nested prompt
    without it saves 2 x 9 reads, with it 3 x 4."""
    rows = [[1] * 4 + [0], [1] * 9 + [2], [1] * 9 + [3], [1] * 9 + [4]]
    groups = find_prefix_groups(*arrays(rows, [1] * 4), min_len=2)
    assert groups == [PrefixGroup((1, 2, 3), 9)]
    # Many rows on the outer prompt: keeping them all saves more (7 x 4 > 5 x 4 + 1 x 9 is not
    # found: neither of the first two anchors sees the pair's longer prompt).
    rows = [[1] * 4 + [i] for i in range(6)] + [[1] * 9 + [7], [1] * 9 + [8]]
    groups = find_prefix_groups(*arrays(rows, [1] * 8), min_len=2)
    assert groups == [PrefixGroup(tuple(range(8)), 4)]


def test_rows_on_a_nested_prompt_group_apart() -> None:
    """Four rows on prompt A + B (12 slots), six on A alone (7): one group of all saves 9 x 7,
    two groups 3 x 12 + 5 x 7; whichever row comes first."""
    a, b = list(range(1, 8)), list(range(8, 13))
    on_ab = [[*a, *b, 100 + i] for i in range(4)]
    on_a = [[*a, 200 + i] for i in range(6)]
    groups = find_prefix_groups(*arrays(on_ab + on_a, [1] * 10), min_len=2)
    assert groups == [PrefixGroup((0, 1, 2, 3), 12), PrefixGroup(tuple(range(4, 10)), 7)]
    # The first row on A alone: the three on A + B still go apart (2 x 12 + 5 x 7 > 8 x 7).
    rows = [on_a[0], *on_ab[:3], *on_a[1:]]
    groups = find_prefix_groups(*arrays(rows, [1] * 9), min_len=2)
    assert groups == [PrefixGroup((0, 4, 5, 6, 7, 8), 7), PrefixGroup((1, 2, 3), 12)]
