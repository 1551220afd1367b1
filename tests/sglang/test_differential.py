"""Differential test: SGLang's own RadixCache and TokenCacheRadixCache get the same op streams.

At every step both must report the same matched length and slots, insert prefix length, lock
deltas, evicted count, allocator frees, request rows / kv fields after checkpoints, and the
same evictable / protected / total sizes.

Eviction ties: RadixCache orders leaves by time.monotonic() stamps (LRU/LFU) or creation
stamps (FIFO), taken once per operation, so two distinct leaves never share a stamp; before
each evict the test asserts that no two evictable reference leaves share a priority, which
makes the evicted set unambiguous and lets it be compared exactly (as a sorted multiset,
since our backend frees all leaves of one evict in one allocator call).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SEQ = st.integers(0, 11)
POS = st.integers(0, 1000)
NS = st.integers(0, 2)
PICK = st.integers(0, 1000)

OPS = st.one_of(
    st.tuples(st.just("insert"), SEQ, POS, NS),
    st.tuples(st.just("match"), SEQ, POS, NS),
    st.tuples(st.just("lock"), SEQ, POS, NS),
    st.tuples(st.just("unlock"), PICK),
    st.tuples(st.just("evict"), st.integers(1, 120)),
    st.tuples(st.just("start"), SEQ, POS, NS),
    st.tuples(st.just("extend"), PICK, st.integers(1, 70)),
    st.tuples(st.just("finish"), PICK),
    st.tuples(st.just("abort"), PICK),
)

CONFIGS = [
    (1, False, "lru"),
    (1, True, "lru"),
    (16, False, "lru"),
    (16, True, "lru"),
    (1, False, "lfu"),
    (16, True, "lfu"),
    (1, False, "fifo"),
    (16, False, "fifo"),
]

MAX_LIVE_REQS = 8


def build_pair(sgl: SimpleNamespace, page_size: int, policy: str) -> tuple[Any, Any]:
    from sgl_harness import make_side

    def params(allocator: Any) -> Any:
        return sgl.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            eviction_policy=policy,
            enable_kv_cache_events=True,
        )

    def reference(allocator: Any) -> Any:
        return sgl.RadixCache(params(allocator))

    def ours(allocator: Any) -> Any:
        return sgl.cache.TokenCacheRadixCache(params(allocator))

    return make_side(reference, page_size), make_side(ours, page_size)


def removed_pages(cache: Any) -> tuple[list[Any], list[int]]:
    """Events other than removals (in order), and the removed pages as a sorted multiset."""
    events = cache.take_events()
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    others = [e for e in events if type(e).__name__ != "BlockRemoved"]
    return others, sorted(h for e in removed for h in e.block_hashes)


def run_stream(
    sgl: SimpleNamespace,
    page_size: int,
    use_ns: bool,
    policy: str,
    seed: int,
    ops: list[tuple],
) -> None:
    from sgl_harness import SlotSource, corpus, reference_leaf_priorities_distinct

    ref, ours = build_pair(sgl, page_size, policy)
    seqs = corpus(seed, page_size)
    source = SlotSource(page_size)
    next_row = 0

    def same(what: str, a: Any, b: Any, ctx: str) -> None:
        assert a == b, f"{ctx}: {what} differs\n  sglang:     {a}\n  tokencache: {b}"

    for step, op in enumerate(ops):
        ctx = f"step {step} {op}"
        kind = op[0]
        if kind in ("insert", "match", "lock"):
            seq = seqs[op[1]]
            tokens = seq[: op[2] % (len(seq) + 1)]
            ns = op[3] if use_ns else 0
            if kind == "insert":
                slots = source.pages(len(tokens) // page_size)
                same(
                    "insert prefix_len",
                    ref.insert(tokens, slots, ns),
                    ours.insert(tokens, slots, ns),
                    ctx,
                )
            elif kind == "match":
                same("match", ref.match(tokens, ns)[:2], ours.match(tokens, ns)[:2], ctx)
            else:
                same("lock", ref.lock_match(tokens, ns), ours.lock_match(tokens, ns), ctx)
        elif kind == "unlock":
            if ref.locks:
                same("unlock delta", ref.unlock(op[1]), ours.unlock(op[1]), ctx)
        elif kind == "evict":
            assert reference_leaf_priorities_distinct(ref.cache), f"{ctx}: LRU tie in reference"
            same("evicted", ref.evict(op[1]), ours.evict(op[1]), ctx)
        elif kind == "start":
            if len(ref.reqs) >= MAX_LIVE_REQS:
                continue
            seq = seqs[op[1]]
            prompt_len = 1 + op[2] % len(seq)
            ns = op[3] if use_ns else 0
            rid = f"r{step}"
            row = next_row % 60
            next_row += 1
            same(
                "admission",
                ref.start(rid, seq, prompt_len, ns, row),
                ours.start(rid, seq, prompt_len, ns, row),
                ctx,
            )
        elif kind == "extend":
            if not ref.reqs:
                continue
            rid = sorted(ref.reqs)[op[1] % len(ref.reqs)]
            req = ref.reqs[rid]
            end = min(len(req.seq), req.committed + op[2])
            if end == req.committed:
                continue
            # Both rows get the same fresh slots; the reference draws them first.
            pages_before = source.next_page
            view_ref = ref.extend(rid, end, source)
            pages_after = source.next_page
            source.next_page = pages_before
            view_ours = ours.extend(rid, end, source)
            assert source.next_page == pages_after
            same("request after checkpoint", view_ref, view_ours, ctx)
        elif kind in ("finish", "abort"):
            if not ref.reqs:
                continue
            rid = sorted(ref.reqs)[op[1] % len(ref.reqs)]
            checkpoint = kind == "finish"
            same(
                "release",
                ref.release(rid, checkpoint=checkpoint),
                ours.release(rid, checkpoint=checkpoint),
                ctx,
            )
        same("frees", ref.alloc.take(), ours.alloc.take(), ctx)
        same("sizes (evictable, protected, total)", ref.sizes(), ours.sizes(), ctx)
        same("dfs-weight order", ref.dfs_order(), ours.dfs_order(), ctx)
        same("kv events", ref.cache.take_events(), ours.cache.take_events(), ctx)

    # Drain: finish every request, drop every lock; then everything is evictable.
    for rid in sorted(ref.reqs):
        same(
            "final release",
            ref.release(rid, checkpoint=True),
            ours.release(rid, checkpoint=True),
            "drain",
        )
    while ref.locks:
        same("final unlock", ref.unlock(0), ours.unlock(0), "drain")
    same("frees", ref.alloc.take(), ours.alloc.take(), "drain")
    same("cached slots", ref.all_values(), ours.all_values(), "drain")
    same("sizes", ref.sizes(), ours.sizes(), "drain")
    assert ours.cache.protected_size() == 0
    assert ours.cache.evictable_size() == ours.cache.total_size()
    ours.cache.tree.check_invariants()
    total = ref.cache.total_size()
    same("evict all", ref.evict(total + 1), ours.evict(total + 1), "drain")
    # Evicting everything pops leaves whose LRU stamps tie, in an unspecified order: compare
    # the removed pages as a multiset here (every earlier evict was checked tie-free).
    same("removed pages", removed_pages(ref.cache), removed_pages(ours.cache), "drain")
    same("frees", ref.alloc.take(), ours.alloc.take(), "drain")
    assert ours.sizes() == (0, 0, 0)


@pytest.mark.parametrize(("page_size", "use_ns", "policy"), CONFIGS)
def test_random_streams(sgl: SimpleNamespace, page_size: int, use_ns: bool, policy: str) -> None:
    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(seed=st.integers(0, 2**16), ops=st.lists(OPS, min_size=5, max_size=80))
    def check(seed: int, ops: list[tuple]) -> None:
        run_stream(sgl, page_size, use_ns, policy, seed, ops)

    check()


def random_ops(rng: np.random.Generator, count: int) -> list[tuple]:
    """A long stream weighted towards requests, with eviction pressure."""
    kinds = [
        "insert",
        "match",
        "lock",
        "unlock",
        "evict",
        "start",
        "extend",
        "extend",
        "extend",
        "finish",
        "abort",
    ]
    weights = np.array([2, 2, 1, 1, 2, 2, 3, 3, 3, 1.5, 0.5])
    ops: list[tuple] = []
    for kind in rng.choice(kinds, size=count, p=weights / weights.sum()):
        a, b, c = (int(x) for x in rng.integers(0, 1000, size=3))
        if kind in ("insert", "match", "lock", "start"):
            ops.append((kind, a % 12, b, c % 3))
        elif kind == "evict":
            ops.append((kind, 1 + a % 120))
        elif kind == "extend":
            ops.append((kind, a, 1 + b % 70))
        else:
            ops.append((kind, a))
    return ops


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_long_seeded_streams(sgl: SimpleNamespace, page_size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    run_stream(sgl, page_size, True, "lru", seed, random_ops(rng, 600))


def test_final_checkpoint_refreshes_whole_path(sgl: SimpleNamespace) -> None:
    """Shrunk from a failing long stream: a request that finishes without new tokens still
    makes its whole path most recently used in RadixCache (the checkpoint re-matches it), so
    the other request's older leaf goes first."""
    ops = [
        ("start", 7, 818, 1),
        ("extend", 236, 11),
        ("start", 5, 756, 1),
        ("extend", 201, 67),
        ("match", 8, 369, 1),
        ("finish", 496),
        ("finish", 140),
        ("evict", 50),
    ]
    run_stream(sgl, 1, True, "lru", 0, ops)


def test_lfu_counts_inserts_not_matches(sgl: SimpleNamespace) -> None:
    """Insert A, insert B twice, match A three times: RadixCache's LFU evicts A (1 hit vs 2)."""
    from sgl_harness import corpus

    seqs = corpus(0, 1)
    a, b = 7, 5
    assert seqs[a][0] != seqs[b][0]
    ops = [
        ("insert", a, len(seqs[a]), 0),
        ("insert", b, len(seqs[b]), 0),
        ("insert", b, len(seqs[b]), 0),
        ("match", a, len(seqs[a]), 0),
        ("match", a, len(seqs[a]), 0),
        ("match", a, len(seqs[a]), 0),
        ("evict", 1),
    ]
    run_stream(sgl, 1, False, "lfu", 0, ops)


def test_checkpoints_move_the_cursor(sgl: SimpleNamespace) -> None:
    """Repeated checkpoints keep one cursor lock (the O(new tokens) path), never re-lock."""
    from sgl_harness import SlotSource, corpus

    _, ours = build_pair(sgl, 16, "lru")
    source = SlotSource(16)
    seq = corpus(3, 16)[0]
    ours.start("r", seq, len(seq) // 2, 0, row=0)
    req = ours.reqs["r"]
    lock = req.lock
    assert isinstance(lock, sgl.cache.CursorLock)
    for end in range(1, len(seq) + 1, 7):
        if end > req.committed:
            ours.extend("r", end, source)
            assert req.lock is lock
            assert lock.cursor.length == req.kv.cache_protected_len == end // 16 * 16
            assert lock.node == lock.cursor.node == req.last_node
    ours.release("r", checkpoint=True)
    assert lock.cursor is None
    assert ours.cache.protected_size() == 0


def test_fifo_split_parent_is_new(sgl: SimpleNamespace) -> None:
    """Insert A, insert B, match a prefix of A (splitting it): under SGLang's FIFO the split-off
    parent is the newest node, so after A's tail the next victim is B, not A's head."""
    from sgl_harness import corpus

    seqs = corpus(0, 1)
    a, b = 7, 5
    assert seqs[a][0] != seqs[b][0]
    ops = [
        ("insert", a, len(seqs[a]), 0),
        ("insert", b, len(seqs[b]), 0),
        ("match", a, 3, 0),
        ("evict", len(seqs[a]) - 2),
    ]
    run_stream(sgl, 1, False, "fifo", 0, ops)
