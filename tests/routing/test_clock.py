"""The GPU cost clock: fitted to the measurements it ships with, exact on synthetic data, and it
prices schedules without changing tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_helpers import bernoulli_decide, make_prompts

from tokencache_models import (
    MIN_SHARED_PREFIX,
    PRESETS,
    PrefixGroup,
    PrefixShape,
    prefix_traffic,
    shared_prefix_len,
)
from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    GpuClock,
    RoutedEngine,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.sim.clock import DATA, NO_PREFIX, PrefixRead, Roofline

SMALL, LARGE = 0, 1


# each profile and the path its runner decoded on
DECODE_PATHS = {"h200-2026-11-30": "torch", "h200-2026-12-04": "graphs"}


def measured(profile: str, model: str, batch: int) -> float:
    rows = json.loads((DATA / f"{profile}.json").read_text())["rows"]
    (row,) = [
        r
        for r in rows
        if r["model"] == model and r["path"] == DECODE_PATHS[profile] and r["kind"] == "decode"
        and r["batch"] == batch and r["context"] == 2048
    ]  # fmt: skip
    return float(row["step_ms"]) / 1e3


@pytest.mark.parametrize("profile", sorted(DECODE_PATHS))
@pytest.mark.parametrize("batch", [1, 8, 32, 128])
def test_fit_reproduces_the_measured_decode_steps(profile: str, batch: int) -> None:
    clock = GpuClock(profile=profile, shared_prefix=False)
    for kind, model in ((SMALL, "qwen3-0.6b"), (LARGE, "qwen3-8b")):
        got = clock.forward_s(kind, batch, batch, batch * 2048)
        assert got == pytest.approx(measured(profile, model, batch), rel=0.2)


def test_fit_recovers_synthetic_coefficients(tmp_path: Path) -> None:
    a, b, c, d = 0.004, 2e-5, 3e-4, 1e-8
    rows = []
    for batch, new, ctx in [(1, 1, 512), (8, 8, 2048), (32, 32, 4096), (64, 64, 1024)]:
        rows.append({"model": "qwen3-0.6b", "batch": batch, "new_tokens": new, "context": ctx,
                     "step_ms": 1e3 * (a + b * batch + c * new + d * batch * ctx)})  # fmt: skip
    for batch, new, ctx in [(2, 40, 2048), (8, 90, 8192), (4, 300, 512), (16, 64, 4096)]:
        rows.append({"model": "qwen3-8b", "batch": batch, "new_tokens": new, "context": ctx,
                     "step_ms": 1e3 * (2 * a + c * new + d * batch * ctx)})  # fmt: skip
    rows.append({"model": "qwen3-8b", "batch": 4, "new_tokens": 4, "context": 64, "step_ms": 9.0})
    rows.append({"model": "qwen3-8b", "batch": 8, "new_tokens": 8, "context": 64, "step_ms": 9.0})
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"rows": rows}))
    clock = GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b")
    assert clock.forward_s(SMALL, 16, 16, 16 * 3000) == pytest.approx(
        a + b * 16 + c * 16 + d * 16 * 3000, rel=1e-6
    )
    # multi-token forwards of the large model have their own fit; its decode stays flat
    assert clock.forward_s(LARGE, 10, 100, 10 * 2000) == pytest.approx(
        2 * a + c * 100 + d * 10 * 2000, rel=1e-6
    )
    assert clock.forward_s(LARGE, 32, 32, 32 * 64) == pytest.approx(9e-3, rel=1e-6)


def test_roofline_profile_is_the_bound_times_its_slack() -> None:
    clock = GpuClock(profile="h200-roofline")
    small = clock.forward_s(SMALL, 32, 32, 32 * 2048)
    large = clock.forward_s(LARGE, 32, 32, 32 * 2048)
    assert 1.5e-3 < small < 4e-3 and 5e-3 < large < 12e-3  # the runner's targets are 3 and 8 ms
    assert clock.forward_s(SMALL, 32, 32, 32 * 8192) > small  # more KV to read
    roof = Roofline.of("qwen3-8b")
    prefill = clock.forward_s(LARGE, 1, 4096, 4096)
    assert prefill == pytest.approx(1.5 * roof.flops_per_token * 4096 / roof.peak_flops)


def test_bad_profile_or_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="profile"):
        GpuClock(profile="a100")
    with pytest.raises(ValueError, match="shape"):
        GpuClock(small="gpt-5")


@pytest.mark.parametrize("topology", ["one-device", "two-devices"])
def test_gpu_clock_prices_without_changing_tokens(pair: Any, topology: str) -> None:
    router = BernoulliRouter(0.25, seed=31)
    prompts = make_prompts(6, seed=90, shared=5)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, clock="gpu", topology=topology)
    )
    res = eng.generate(prompts, 8)
    ref, _ = reference_generate(*pair, prompts, 8, bernoulli_decide(router))
    assert res.tokens == ref
    st = res.stats
    # at least every small step's fixed cost of the fitted 0.6B decode (~2.3 ms), and on one
    # device every catch-up's of the 8B's multi-token forward (~20 ms + the engine overhead)
    clock = GpuClock()
    small_step, catchup = clock.forward_s(0, 1, 1, 0), clock.forward_s(1, 1, 2, 0)
    assert small_step > 0.002 and catchup > 0.02
    assert st.modeled_s >= st.steps * small_step
    if topology == "one-device":  # serial: small steps and catch-ups add up
        assert st.modeled_s >= st.steps * small_step + len(st.catchup_batch_sizes) * catchup
    assert eng.idle_invariant()


@pytest.mark.parametrize("profile", ["h200-2026-12-04", "h200-2026-11-30", "h200-roofline"])
@settings(max_examples=200, deadline=None)
@given(
    forwards=st.lists(
        st.tuples(
            st.integers(1, 64),  # batch
            st.integers(1, 40),  # new tokens per request
            st.integers(0, 2_000_000),  # KV tokens read
        ),
        min_size=1,
        max_size=12,
    )
)
def test_floor_bounds_every_schedule(profile: str, forwards: list[tuple[int, int, int]]) -> None:
    """However a model's tokens and KV reads are cut into forwards (decode or multi-token),
    their costs add up to at least floor_s of the totals: the bench's ceiling is a real bound.
    The KV term matters: the floor with the KV read grows with it, and stays below what the
    forwards paid."""
    clock = GpuClock(profile=profile)
    total = sum(b * t for b, t, _ in forwards)
    total_kv = sum(kv for _, _, kv in forwards)
    for kind in (SMALL, LARGE):
        paid = sum(clock.forward_s(kind, b, b * t, kv) for b, t, kv in forwards)
        floor = clock.floor_s(kind, total, total_kv)
        assert 0 < clock.floor_s(kind, total) <= floor <= paid * (1 + 1e-12)
        assert floor <= clock.forward_s(kind, 1, total, total_kv) * (1 + 1e-12)


def test_two_devices_small_model_starts_no_request_before_its_submission(pair: Any) -> None:
    """After a catch-up leaves the large clock ahead, a request submitted at now() (the later
    clock) costs the small model its full steps after that instant: an idle small clock does
    not run it in the past."""
    small, large = pair
    router = ScriptedRouter({0: [0]})  # route_key 0 escalates its first token, others never
    eng = RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(
            num_slots=512, large_step_cost=50.0, topology="two-devices", clock="steps"
        ),
    )
    eng.submit([1, 2, 3], 1, route_key=0).wait()
    assert eng._events.t_large > eng._events.t_small  # the catch-up left the large clock ahead
    t0 = eng.now()
    h = eng.submit([4, 5, 6], 6, route_key=1)
    h.wait()
    # Six small steps (a prefill and five decodes), each costing 1 on the step clock.
    assert h.token_times[0] >= t0 + 1
    assert eng.now() - t0 >= 6


def test_fit_reads_what_the_gpu_decode_bench_writes(tmp_path: Path) -> None:
    """A GPU session's benches/gpu/results/ JSON refits the clock directly: the fastest path
    per shape, a catch-up's tokens as the forward's total, skipped rows left out."""
    a, b, d = 0.002, 1e-5, 2e-9  # decode: a + b*batch + d*kv
    c = 4e-5  # catch-up: per token, plus d*kv
    rows: list[dict[str, Any]] = []
    for model, scale in (("qwen3-0.6b", 1.0), ("qwen3-8b", 3.0)):
        for batch in (1, 4, 16, 64):
            t = scale * (a + b * batch + d * batch * 2048)
            rows.append({"model": model, "kind": "decode", "path": "graphs", "batch": batch,
                         "context": 2048, "step_ms": 1e3 * t})  # fmt: skip
            rows.append({"model": model, "kind": "decode", "path": "eager", "batch": batch,
                         "context": 2048, "step_ms": 1e3 * (t + 0.02)})  # fmt: skip
        for k, per, ctx in ((2, 8, 2048), (10, 10, 8192), (4, 50, 1024), (8, 3, 4096)):
            t = scale * (c * k * per + d * k * ctx)
            rows.append({"model": model, "kind": "catch-up", "path": "eager", "batch": k,
                         "new_tokens": per, "context": ctx, "step_ms": 1e3 * t})  # fmt: skip
        rows.append({"model": model, "kind": "decode", "path": "torch", "batch": 256,
                     "context": 2048, "skipped": "time budget"})  # fmt: skip
    path = tmp_path / "nvidia-h200-2026-12-02.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "rows": rows, "checks": []}))
    clock = GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b")
    # Decode priced at the graphs rows (not eager's +20 ms), catch-ups per total token.
    assert clock.forward_s(SMALL, 32, 32, 32 * 2048) == pytest.approx(
        a + b * 32 + d * 32 * 2048, rel=1e-6
    )
    assert clock.forward_s(LARGE, 6, 60, 6 * 3000) == pytest.approx(
        3 * (c * 60 + d * 6 * 3000), rel=1e-6
    )


def one_prefix_read(shape: PrefixShape, prefix: int) -> int:
    """KV slots one 32-row decode group on `prefix` slots reads (prefix once per pass, plus
    every token's split partials), by hand."""
    return prefix * shape.passes(32) + shape.overhead_slots(32)


def test_fit_prices_shared_decode_rows_by_the_kv_they_read(tmp_path: Path) -> None:
    """A GPU run of the shared-prefix runner: its shared-decode rows enter the fit with the KV
    they read (kv_tokens: the prefix once per pass), and the file's shared_prefix_attention
    switches the fitted clock's mode on. Times here follow a + b*batch + d*kv_read exactly, so
    a fit that took those rows at their nominal context could not reproduce them."""
    a, b, d = 0.002, 1e-5, 2e-9
    rows: list[dict[str, Any]] = []
    for model in ("qwen3-0.6b", "qwen3-8b"):
        for batch in (1, 8, 32):
            rows.append({"model": model, "kind": "decode", "path": "graphs", "batch": batch,
                         "context": 2048, "kv_tokens": batch * 2048,
                         "step_ms": 1e3 * (a + b * batch + d * batch * 2048)})  # fmt: skip
        for ctx in (2048, 8192):
            p = ctx - 160
            kv = 32 * 160 + one_prefix_read(PrefixShape.of(PRESETS[model]), p)
            rows.append({"model": model, "kind": "shared decode", "path": "graphs", "batch": 32,
                         "context": ctx, "shared": p, "kv_tokens": kv,
                         "step_ms": 1e3 * (a + b * 32 + d * kv)})  # fmt: skip
    path = tmp_path / "nvidia-h200-2026-12-02.json"
    data = {"device": "NVIDIA H200", "rows": rows, "checks": [], "shared_prefix_attention": True}
    path.write_text(json.dumps(data))
    clock = GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b")
    assert clock.shared_prefix
    p = 8192 - 160
    for kind, model in ((SMALL, "qwen3-0.6b"), (LARGE, "qwen3-8b")):
        kv = 32 * 160 + one_prefix_read(PrefixShape.of(PRESETS[model]), p)
        every_row = clock.prefix_read(kind, [PrefixGroup(tuple(range(32)), p)], np.arange(33))
        got = clock.forward_s(kind, 32, 32, 32 * 8192, every_row)
        assert got == pytest.approx(a + b * 32 + d * kv, rel=1e-6)
    assert not GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b", shared_prefix=False).shared_prefix


def test_two_devices_late_submission_does_not_stall_the_running_batch(pair: Any) -> None:
    """A request submitted while a catch-up is in flight is stamped with the large model's
    later clock; it waits for the small clock to get there, and the requests already decoding
    keep stepping meanwhile (no jump of the small clock over their steps)."""
    small, large = pair
    router = ScriptedRouter({0: [0]})
    eng = RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(
            num_slots=512, large_step_cost=50.0, topology="two-devices", clock="steps"
        ),
    )
    a = eng.submit([1, 2, 3], 2, route_key=0)
    b = eng.submit([4, 5, 6], 80, route_key=1)
    while not eng.sched.inflight:
        assert eng.iterate()
    c = eng.submit([7, 8, 9], 3, route_key=2)
    assert c.submitted_at > eng._events.t_small + 40  # stamped at the large clock, far ahead
    while eng.iterate():
        pass
    gaps = [y - x for x, y in zip(b.token_times, b.token_times[1:], strict=False)]
    assert max(gaps) <= 1.0 + 1e-9  # b never waited for c's admission
    assert c.token_times[0] >= c.submitted_at + 1
    assert a.finished_reason == b.finished_reason == c.finished_reason == "length"
    assert eng.idle_invariant()


# ---------------------------------------------------------------- shared-prefix reads


Slots = tuple[np.ndarray, np.ndarray, np.ndarray]  # kv_slots, kv_offsets, q_offsets


def built(rows: list[tuple[np.ndarray, int, int]]) -> Slots:
    """Slot lists of rows (prefix slots, own slots, q_len): each row's prefix slots, then
    `own` slots no other row holds (its last q_len new)."""
    lists, nxt = [], 1_000_000
    for prefix, own, _ in rows:
        lists.append(np.concatenate([prefix, np.arange(nxt, nxt + own)]))
        nxt += own
    kv_off = np.concatenate([[0], np.cumsum([len(r) for r in lists])]).astype(np.int64)
    q_off = np.concatenate([[0], np.cumsum([q for _, _, q in rows])]).astype(np.int64)
    return np.concatenate(lists).astype(np.int64), kv_off, q_off


def hand_built(prefix: int, own: list[int], q_lens: list[int]) -> Slots:
    """Slot lists of len(own) rows: the same `prefix` slots, then each row's own slots (its
    last q_len slots new)."""
    return built([(np.arange(prefix), k, q) for k, q in zip(own, q_lens, strict=True)])


@pytest.mark.parametrize("profile", ["h200-2026-12-04", "h200-2026-11-30", "h200-roofline"])
# Decode; a catch-up of several prefix passes (fewer than its rows); one of more passes than
# rows (the runner reads the prefix per row then: paying_groups).
@pytest.mark.parametrize("q_len", [1, 3, 30])
def test_kv_term_reads_a_shared_prefix_once_per_pass(profile: str, q_len: int) -> None:
    """On a hand-built batch over one prompt: with shared_prefix the clock's KV term is
    sum(kv_lens) - n*P + P*passes + the partials' slots when that is less than n*P, without
    it (or when it is not) sum(kv_lens), whatever the profile."""
    own = [40, 33, 57, 35]
    slots, kv_off, q_off = hand_built(3000, own, [q_len] * len(own))
    kv_lens = np.diff(kv_off)
    n, total, tokens = len(own), int(kv_lens.sum()), q_len * len(own)
    on = GpuClock(profile=profile, shared_prefix=True)
    off = GpuClock(profile=profile, shared_prefix=False)
    p = 3000
    import torch  # the engine passes its ForwardBatch's CPU tensors

    for kind, name in ((SMALL, "qwen3-0.6b"), (LARGE, "qwen3-8b")):
        pre = on.prefix_of(kind, slots, kv_off, q_off)
        assert on.prefix_of(kind, *(torch.from_numpy(x) for x in (slots, kv_off, q_off))) == pre
        shape = PrefixShape.of(PRESETS[name])
        passes = shape.passes(tokens)
        assert passes == (1 if q_len == 1 else -(-tokens // (32 if kind == LARGE else 64)))
        # Partials: 4 query tokens x heads x splits (one wave over passes x 8 kv heads; a
        # catch-up's capped by P / 256) x 130 fp32, written and read, in slots of 4 KiB.
        splits = 17 if q_len == 1 else min(-(-132 // (passes * 8)), 3000 // 256)
        heads = 16 if kind == SMALL else 32
        partials = -(-2 * tokens * heads * splits * 130 * 4 // 4096)
        assert shape.overhead_slots(tokens, None if q_len == 1 else p) == partials
        pays = p * passes + partials < n * p
        assert pays == (passes < n)  # at 3000 slots, the passes decide
        group = PrefixGroup(tuple(range(n)), p)
        assert pre == (PrefixRead((group,), n * p, p * passes + partials) if pays else NO_PREFIX)
        assert pre.longest == (p if pays else 0)
        want = total - n * p + p * passes + partials if pays else total
        assert on.kv_read(total, pre) == want
        assert on.forward_s(kind, n, tokens, total, pre) == on.costs[kind](n, tokens, want)
        assert off.prefix_of(kind, slots, kv_off, q_off) == NO_PREFIX
        assert off.kv_read(total, pre) == total  # a clock without the path ignores any groups
        assert off.forward_s(kind, n, tokens, total, pre) == off.costs[kind](n, tokens, total)
        assert on.kv_read(total) == total  # NO_PREFIX: nothing shared
        # A prefix under MIN_SHARED_PREFIX, or one row, is not shared.
        short = hand_built(MIN_SHARED_PREFIX - 1, own, [1] * len(own))
        assert on.prefix_of(kind, *short) == NO_PREFIX
        assert on.prefix_of(kind, *hand_built(300, own[:1], [1])) == NO_PREFIX


# Two system prompts (A: 2500 slots, B: 1200) whose rows interleave, and a row on neither.
A, B = np.arange(2500), np.arange(5000, 6200)
TWO_PROMPT_ROWS = [(A, 0), (B, 1), (A, 0), (B, 1), (A, 0), (A, 0), (B, 1), (np.arange(0), -1)]


@pytest.mark.parametrize("profile", ["h200-2026-12-04", "h200-2026-11-30", "h200-roofline"])
# Decode; a catch-up where the 8B's B rows take as many passes as they are rows (only A's
# group is kept there) while the 0.6B keeps both.
@pytest.mark.parametrize("q_lens", [[1] * 8, [3, 30, 20, 30, 2, 5, 10, 4]])
def test_clock_prices_rows_of_two_prompts_by_their_groups(profile: str, q_lens: list[int]) -> None:
    """Rows from two prompts share no prefix all together (the old single-P rule read none
    once), but each prompt's rows form a group the runner reads once per block of its query
    tokens. The clock's KV term is the hand sum: every row's context, less each kept group's
    rows x P, plus P x passes(its tokens) per kept group and every token's partials; a group
    is kept when its passes are fewer than its rows, and the kept ones only all together when
    they beat the partials."""
    rows = [(pre, 20 + q, q) for (pre, _), q in zip(TWO_PROMPT_ROWS, q_lens, strict=True)]
    slots, kv_off, q_off = built(rows)
    assert shared_prefix_len(slots, kv_off, q_off) == 0
    total, tokens, n = int(kv_off[-1]), int(q_off[-1]), len(rows)
    decode = tokens == n
    clock = GpuClock(profile=profile, shared_prefix=True)
    for kind, name in ((SMALL, "qwen3-0.6b"), (LARGE, "qwen3-8b")):
        shape = PrefixShape.of(PRESETS[name])
        kept = []
        for label, p in ((0, len(A)), (1, len(B))):
            members = tuple(i for i, (_, lab) in enumerate(TWO_PROMPT_ROWS) if lab == label)
            if shape.passes(sum(q_lens[i] for i in members)) < len(members):
                kept.append((members, p))
        longest = max(p for _, p in kept)
        skipped = sum(len(m) * p for m, p in kept)
        read = sum(p * shape.passes(sum(q_lens[i] for i in m)) for m, p in kept)
        read += shape.overhead_slots(tokens, None if decode else longest)
        assert read < skipped  # both cases pay
        if decode:
            assert len(kept) == 2
        else:
            assert len(kept) == (1 if kind == LARGE else 2)
        groups = tuple(PrefixGroup(m, p) for m, p in kept)
        pre = clock.prefix_of(kind, slots, kv_off, q_off)
        assert pre == PrefixRead(groups, skipped, read)
        assert (pre.skipped, pre.read) == prefix_traffic(groups, q_off, shape, decode)
        assert pre.longest == longest and pre.rows == sum(len(m) for m, _ in kept)
        assert clock.kv_read(total, pre) == total - skipped + read < total
        want = clock.costs[kind](n, tokens, total - skipped + read)
        assert clock.forward_s(kind, n, tokens, total, pre) == want


@pytest.mark.parametrize("p", [100, 1000])
@pytest.mark.parametrize("kind", [SMALL, LARGE])
def test_groups_are_kept_all_or_nothing_against_the_partials(p: int, kind: int) -> None:
    """Two decode groups of two rows each read their prefix once (one pass each, fewer than
    their rows), but every token then writes split partials: at P = 100 those cost more than
    the two groups save together, so no group is kept and every row reads its own slots."""
    prompts = (np.arange(p), np.arange(10_000, 10_000 + p))
    slots, kv_off, q_off = built([(prompts[i % 2], 30, 1) for i in range(4)])
    clock = GpuClock(profile="h200-roofline")
    shape = clock.prefix_shapes[kind]
    pays = 2 * p + shape.overhead_slots(4) < 4 * p
    assert pays == (p == 1000)
    pre = clock.prefix_of(kind, slots, kv_off, q_off)
    total = int(kv_off[-1])
    if pays:
        assert [g.rows for g in pre.groups] == [(0, 2), (1, 3)]
        assert clock.kv_read(total, pre) == total - 4 * p + 2 * p + shape.overhead_slots(4)
    else:
        assert pre == NO_PREFIX and clock.kv_read(total, pre) == total


def test_shared_prefix_defaults_and_describe() -> None:
    """The roofline's runner and the one measured on 2026-12-04 read a shared prefix once,
    the one of 2026-11-30 did not; fitted clocks default to what their file says;
    describe() says which."""
    roof, measured = GpuClock(profile="h200-roofline"), GpuClock(profile="h200-2026-11-30")
    assert roof.shared_prefix and not measured.shared_prefix
    assert GpuClock().shared_prefix  # the default profile's runner: decode_step.py says so
    assert "shared prefix read once" in roof.describe()
    assert "KV read per request" in measured.describe()
    assert not GpuClock(profile="h200-roofline", shared_prefix=False).shared_prefix
    assert GpuClock(shared_prefix=True).shared_prefix
    path = DATA / "h200-2026-11-30.json"
    assert not GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b").shared_prefix
    fitted = GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b", shared_prefix=True)
    assert fitted.shared_prefix and "shared prefix read once" in fitted.describe()


Forward = tuple[list[int], list[int], list[PrefixGroup]]  # contexts, new tokens, groups


@st.composite
def grouped_schedules(draw: Any) -> tuple[int, list[Forward]]:
    """(U, forwards): each forward's rows (context, new tokens) and candidate groups of them:
    the rows labelled with one of up to four prompts (-1: none) form a group when at least
    two, with a P of at least MIN_SHARED_PREFIX and at most U (no two rows share more) and
    every member's context before its new tokens. Decode forwards and catch-ups."""
    shareable = draw(st.integers(0, 20_000))
    forwards = []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 40))
        if draw(st.booleans()):
            q = [1] * n
        else:
            q = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
        kv = [qi + draw(st.integers(0, 30_000)) for qi in q]
        labels = draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n))
        groups = []
        for k in range(4):
            rows = tuple(i for i in range(n) if labels[i] == k)
            cap = min([shareable] + [kv[i] - q[i] for i in rows])
            if len(rows) >= 2 and cap >= MIN_SHARED_PREFIX:
                groups.append(PrefixGroup(rows, draw(st.integers(MIN_SHARED_PREFIX, cap))))
        forwards.append((kv, q, groups))
    return shareable, forwards


@pytest.mark.parametrize("profile", ["h200-2026-12-04", "h200-2026-11-30", "h200-roofline"])
@pytest.mark.parametrize("shared", [False, True])
@settings(max_examples=200, deadline=None)
@given(sched=grouped_schedules())
def test_floor_bounds_every_schedule_with_shared_reads(
    profile: str, shared: bool, sched: tuple[int, list[Forward]]
) -> None:
    """The bench's ceiling with shared-prefix reads: however the rows are cut into forwards
    and whatever prefixes each forward's groups share (rows of several prompts, each at most
    the shareable prefix), the forwards cost at least floor_s of the tokens and
    least_kv_read of the rows."""
    shareable, forwards = sched
    clock = GpuClock(profile=profile, shared_prefix=shared)
    rows = sum(len(kv) for kv, _, _ in forwards)
    total_kv = sum(sum(kv) for kv, _, _ in forwards)
    total = sum(sum(q) for _, q, _ in forwards)
    for kind in (SMALL, LARGE):
        least = clock.least_kv_read(kind, total_kv, rows, shareable)
        assert 0 <= least <= total_kv
        pres = [clock.prefix_read(kind, g, np.cumsum([0, *q])) for _, q, g in forwards]
        paid = sum(
            clock.forward_s(kind, len(kv), sum(q), sum(kv), pre)
            for (kv, q, _), pre in zip(forwards, pres, strict=True)
        )
        read = sum(
            clock.kv_read(sum(kv), pre) for (kv, _, _), pre in zip(forwards, pres, strict=True)
        )
        assert least <= read
        assert clock.floor_s(kind, total, least) <= paid * (1 + 1e-12)


@st.composite
def slot_schedules(draw: Any) -> tuple[int, list[Slots]]:
    """(U, forwards' slot lists): rows reading all (mostly) or a leading part of one of up to
    four prompts of at most U slots each (disjoint slots, so rows of two prompts share none)
    or none, then slots of their own: no two rows share more than U leading slots."""
    shareable = draw(st.integers(0, 6000))
    lens = draw(st.lists(st.integers(0, shareable), min_size=1, max_size=4))
    prompts = [np.arange(k * 10_000, k * 10_000 + n) for k, n in enumerate(lens)]
    forwards = []
    for _ in range(draw(st.integers(1, 6))):
        decode = draw(st.booleans())
        rows = []
        for _ in range(draw(st.integers(1, 40))):
            k = draw(st.integers(-1, len(prompts) - 1))
            prompt = prompts[k] if k >= 0 else prompts[0][:0]
            used = draw(st.one_of(st.just(len(prompt)), st.integers(0, len(prompt))))
            q = 1 if decode else draw(st.integers(1, 40))
            rows.append((prompt[:used], q + draw(st.integers(0, 500)), q))
        forwards.append(built(rows))
    return shareable, forwards


@pytest.mark.parametrize("profile", ["h200-2026-12-04", "h200-2026-11-30", "h200-roofline"])
@settings(max_examples=60, deadline=None)
@given(sched=slot_schedules())
def test_floor_bounds_the_groups_the_runner_finds(
    profile: str, sched: tuple[int, list[Slots]]
) -> None:
    """The same bound over the groups the runner's rule finds in real slot lists (rows of
    several prompts, some reading only part of theirs): no group shares more than U, and
    least_kv_read stays below what the forwards read."""
    shareable, forwards = sched
    clock = GpuClock(profile=profile, shared_prefix=True)
    rows = sum(len(kv_off) - 1 for _, kv_off, _ in forwards)
    total_kv = sum(int(kv_off[-1]) for _, kv_off, _ in forwards)
    total = sum(int(q_off[-1]) for _, _, q_off in forwards)
    for kind in (SMALL, LARGE):
        least = clock.least_kv_read(kind, total_kv, rows, shareable)
        pres = [clock.prefix_of(kind, *f) for f in forwards]
        assert all(g.length <= shareable for pre in pres for g in pre.groups)
        read = sum(clock.kv_read(int(f[1][-1]), pre) for f, pre in zip(forwards, pres, strict=True))
        paid = sum(
            clock.forward_s(kind, len(f[1]) - 1, int(f[2][-1]), int(f[1][-1]), pre)
            for f, pre in zip(forwards, pres, strict=True)
        )
        assert least <= read
        assert clock.floor_s(kind, total, least) <= paid * (1 + 1e-12)


@pytest.mark.parametrize("kind", [SMALL, LARGE])
def test_shared_floor_is_tight_so_an_overstated_one_fails(kind: int) -> None:
    """One decode forward whose rows share exactly the shareable prefix reads what
    least_kv_read says plus its partials' traffic: the roofline floor of that equals its cost,
    so any floor that counts the shared prefix more often (per row, or one pass more) is above
    what a schedule paid, and the bound check above would catch it."""
    clock = GpuClock(profile="h200-roofline")
    shareable, own = 8000, 150
    n = 64 if kind == LARGE else 128  # two passes: 32 (8B, group 4) or 64 (0.6B) rows a pass
    total_kv = n * (shareable + own)
    passes = 2
    every_row = clock.prefix_read(kind, [PrefixGroup(tuple(range(n)), shareable)], np.arange(n + 1))
    paid = clock.forward_s(kind, n, n, total_kv, every_row)
    least = clock.least_kv_read(kind, total_kv, n, shareable)
    assert least == total_kv - (n - passes) * shareable
    partials = clock.prefix_shapes[kind].overhead_slots(n)
    assert 0 < partials < shareable
    assert clock.floor_s(kind, n, least + partials) == pytest.approx(paid, rel=1e-12)
    for over in (least + shareable, total_kv):
        assert clock.floor_s(kind, n, over) > paid * (1 + 1e-9)


@pytest.mark.parametrize("kind", [SMALL, LARGE])
def test_shared_floor_with_two_prompts_is_loose_by_their_extra_passes(kind: int) -> None:
    """Rows of two prompts need a group each, so a pass each: one decode forward of both
    halves reads least_kv_read plus its partials plus (passes(half) x 2 - passes(all)) x U,
    the documented looseness; still a lower bound."""
    clock = GpuClock(profile="h200-roofline")
    shape = clock.prefix_shapes[kind]
    shareable, own = 8000, 150
    half = shape.tokens_per_block + 8  # two passes each, three for both together
    n = 2 * half
    groups = [PrefixGroup(tuple(range(k, n, 2)), shareable) for k in (0, 1)]
    pre = clock.prefix_read(kind, groups, np.arange(n + 1))
    assert pre.groups == tuple(groups)
    total_kv = n * (shareable + own)
    least = clock.least_kv_read(kind, total_kv, n, shareable)
    extra = (2 * shape.passes(half) - shape.passes(n)) * shareable
    assert extra == shareable
    assert clock.kv_read(total_kv, pre) == least + shape.overhead_slots(n) + extra


def _no_time() -> float:
    return 0.0


def run_primed(
    pair: Any, clock: GpuClock, dispatch: str, prompts: list[list[int]], systems: list[list[int]]
) -> tuple[list[list[int]], Any]:
    """generate(prompts, 8) after priming both trees with the system prompts, as the bench does;
    no host time, so the clock is a pure function of the schedule. (tokens, stats since).
    Every dispatch on the one schedule without overlap (the naive ones have none), so the
    catch-up batches compared are the same."""
    router = BernoulliRouter(0.3, seed=5)
    eng = RoutedEngine(
        *pair,
        router,
        config=EngineConfig(num_slots=2048, clock=clock, dispatch=dispatch, overlap=False),
    )
    for side in eng.sides:
        side.timer = _no_time
    eng.router = ScriptedRouter(every=True)
    for k, system in enumerate(systems):
        eng.submit(system, 1, route_key=-1 - k).wait()
    eng.router = router
    start = eng.stats.copy()
    res = eng.generate(prompts, 8)
    assert eng.idle_invariant()
    return res.tokens, eng.stats.since(start)


@pytest.mark.parametrize("dispatch", ["naive", "tokencache"])
def test_engine_prices_shared_prefixes_for_every_dispatch(pair: Any, dispatch: str) -> None:
    """Every dispatch is priced on the same runner: with shared_prefix the engine finds each
    forward's group (the primed prompt, shared by every row), the catch-ups record it, the
    clock runs ahead less, and the tokens are the same."""
    prompts = make_prompts(8, seed=11, shared=100)
    out = {}
    for shared in (False, True):
        clock = GpuClock(profile="h200-roofline", shared_prefix=shared)
        out[shared] = run_primed(pair, clock, dispatch, prompts, [prompts[0][:100]])
    (tok_off, st_off), (tok_on, st_on) = out[False], out[True]
    assert tok_on == tok_off
    assert set(st_off.catchup_shared_prefix) == {NO_PREFIX}
    assert len(st_on.catchup_shared_prefix) == len(st_on.catchup_batch_sizes)
    pairs = zip(st_on.catchup_batch_sizes, st_on.catchup_shared_prefix, strict=True)
    shared_rows = [(b, pre) for b, pre in pairs if pre.groups]
    assert shared_rows
    for b, pre in shared_rows:
        assert b >= pre.rows >= 2 and pre.longest >= 100 and pre.saved > 0
    assert st_on.modeled_s < st_off.modeled_s


class SpyClock(GpuClock):
    """Records what prefix_of found and what forward_s priced, with the model kind of each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.found: list[tuple[int, PrefixRead]] = []
        self.priced: list[tuple[int, PrefixRead]] = []

    def prefix_of_host(self, kind: int, host: Any) -> PrefixRead:
        pre = super().prefix_of_host(kind, host)
        self.found.append((kind, pre))
        return pre

    def forward_s(
        self,
        kind: int,
        batch: int,
        new_tokens: int,
        kv_tokens: int,
        prefix: PrefixRead = NO_PREFIX,
    ) -> float:
        self.priced.append((kind, prefix))
        return super().forward_s(kind, batch, new_tokens, kv_tokens, prefix)


@pytest.mark.parametrize("dispatch", ["naive", "tokencache"])
def test_engine_reads_two_system_prompts_as_two_groups(pair: Any, dispatch: str) -> None:
    """Requests on two primed system prompts, alternating: catch-ups mixing both read each
    prompt once per block of its rows (two groups, each at least its prompt long, disjoint,
    within the batch), every forward is priced with the groups found for its own model's
    shape, the catch-ups record what they were priced with, and the clock is ahead less than
    a runner reading per row."""
    systems = [make_prompts(1, seed=s, shared=150, lo=0, hi=0)[0] for s in (3, 4)]
    assert systems[0][0] != systems[1][0]  # distinct from their first token: no common prefix
    own = make_prompts(12, seed=12, shared=0)
    prompts = [systems[i % 2] + q for i, q in enumerate(own)]
    off = GpuClock(profile="h200-roofline", shared_prefix=False)
    on = SpyClock(profile="h200-roofline", shared_prefix=True)
    tok_off, st_off = run_primed(pair, off, dispatch, prompts, systems)
    tok_on, st_on = run_primed(pair, on, dispatch, prompts, systems)
    assert tok_on == tok_off
    assert on.found == on.priced and {k for k, _ in on.found} == {SMALL, LARGE}
    large = [pre for k, pre in on.priced if k == LARGE]
    assert st_on.catchup_shared_prefix == large[len(large) - len(st_on.catchup_batch_sizes) :]
    pairs = list(zip(st_on.catchup_batch_sizes, st_on.catchup_shared_prefix, strict=True))
    two = [(size, pre) for size, pre in pairs if len(pre.groups) == 2]
    assert two, "no catch-up read both prompts once"
    for size, pre in two:
        rows = [r for g in pre.groups for r in g.rows]
        assert len(set(rows)) == len(rows) and max(rows) < size
        assert all(g.length >= 150 for g in pre.groups)
        assert 0 < pre.saved < pre.skipped
    assert st_on.modeled_s < st_off.modeled_s
