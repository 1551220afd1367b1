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
from routing_helpers import make_prompts
from test_exactness import bernoulli_decide

from tokencache_models import MIN_SHARED_PREFIX, PRESETS, PrefixShape
from tokencache_routing import (
    BernoulliRouter,
    GpuClock,
    RoutedEngine,
    ScriptedRouter,
    reference_generate,
)
from tokencache_routing.clock import DATA, Roofline

SMALL, LARGE = 0, 1


def measured(model: str, batch: int) -> float:
    rows = json.loads((DATA / "h200-2026-11-30.json").read_text())["rows"]
    (row,) = [
        r
        for r in rows
        if r["model"] == model and r["path"] == "torch" and r["kind"] == "decode"
        and r["batch"] == batch
    ]  # fmt: skip
    return float(row["step_ms"]) / 1e3


@pytest.mark.parametrize("batch", [1, 8, 32, 128])
def test_fit_reproduces_the_measured_decode_steps(batch: int) -> None:
    clock = GpuClock()
    for kind, model in ((SMALL, "qwen3-0.6b"), (LARGE, "qwen3-8b")):
        got = clock.forward_s(kind, batch, batch, batch * 2048)
        assert got == pytest.approx(measured(model, batch), rel=0.2)


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
    assert 1.5e-3 < small < 4e-3 and 5e-3 < large < 12e-3  # issue 9's targets are 3 and 8 ms
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
    eng = RoutedEngine(*pair, router, 512, clock="gpu", topology=topology)
    res = eng.generate(prompts, 8)
    ref, _ = reference_generate(*pair, prompts, 8, bernoulli_decide(router))
    assert res.tokens == ref
    st = res.stats
    # at least every small step's fixed cost of the fitted 0.6B decode (~23 ms)
    assert st.modeled_s >= st.steps * 0.02
    if topology == "one-device":  # serial: small steps and catch-ups add up
        assert st.modeled_s >= st.steps * 0.02 + len(st.catchup_batch_sizes) * 0.02
    assert eng.idle_invariant()


@pytest.mark.parametrize("profile", ["h200-2026-11-30", "h200-roofline"])
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
        small, large, router, 512, large_step_cost=50.0, topology="two-devices", clock="steps"
    )
    eng.submit([1, 2, 3], 1, route_key=0).wait()
    assert eng._t_large > eng._t_small  # the catch-up left the large clock ahead
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
            kv = 32 * 160 + PrefixShape.of(PRESETS[model]).read_slots(32, p, decode=True)
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
        kv = 32 * 160 + PrefixShape.of(PRESETS[model]).read_slots(32, p, decode=True)
        got = clock.forward_s(kind, 32, 32, 32 * 8192, p)
        assert got == pytest.approx(a + b * 32 + d * kv, rel=1e-6)
    assert not GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b", shared_prefix=False).shared_prefix


def test_two_devices_late_submission_does_not_stall_the_running_batch(pair: Any) -> None:
    """A request submitted while a catch-up is in flight is stamped with the large model's
    later clock; it waits for the small clock to get there, and the requests already decoding
    keep stepping meanwhile (no jump of the small clock over their steps)."""
    small, large = pair
    router = ScriptedRouter({0: [0]})
    eng = RoutedEngine(
        small, large, router, 512, large_step_cost=50.0, topology="two-devices", clock="steps"
    )
    a = eng.submit([1, 2, 3], 2, route_key=0)
    b = eng.submit([4, 5, 6], 80, route_key=1)
    while not eng.sched.inflight:
        assert eng.iterate()
    c = eng.submit([7, 8, 9], 3, route_key=2)
    assert c.submitted_at > eng._t_small + 40  # stamped at the large clock, far ahead
    while eng.iterate():
        pass
    gaps = [y - x for x, y in zip(b.token_times, b.token_times[1:], strict=False)]
    assert max(gaps) <= 1.0 + 1e-9  # b never waited for c's admission
    assert c.token_times[0] >= c.submitted_at + 1
    assert a.finished_reason == b.finished_reason == c.finished_reason == "length"
    assert eng.idle_invariant()


# ---------------------------------------------------------------- shared-prefix reads


def hand_built(prefix: int, own: list[int], q_lens: list[int]) -> tuple[np.ndarray, ...]:
    """Slot lists of len(own) rows: the same `prefix` slots, then each row's own slots (its
    last q_len slots new)."""
    rows, nxt = [], 10_000
    for k in own:
        rows.append(np.concatenate([np.arange(prefix), np.arange(nxt, nxt + k)]))
        nxt += k
    kv_off = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    q_off = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return np.concatenate(rows).astype(np.int64), kv_off, q_off


@pytest.mark.parametrize("profile", ["h200-2026-11-30", "h200-roofline"])
# Decode; a catch-up of several prefix passes (fewer than its rows); one of more passes than
# rows (the runner reads the prefix per row then: PrefixShape.pays).
@pytest.mark.parametrize("q_len", [1, 3, 30])
def test_kv_term_reads_a_shared_prefix_once_per_pass(profile: str, q_len: int) -> None:
    """On a hand-built batch: with shared_prefix the clock's KV term is
    sum(kv_lens) - n*P + P*passes + the partials' slots when that is less than n*P, without
    it (or when it is not) sum(kv_lens), whatever the profile."""
    own = [40, 33, 57, 35]
    slots, kv_off, q_off = hand_built(3000, own, [q_len] * len(own))
    kv_lens = np.diff(kv_off)
    n, total, tokens = len(own), int(kv_lens.sum()), q_len * len(own)
    on = GpuClock(profile=profile, shared_prefix=True)
    off = GpuClock(profile=profile, shared_prefix=False)
    p = on.prefix_of(slots, kv_off, q_off)
    assert p == 3000
    import torch  # the engine passes its ForwardBatch's CPU tensors

    assert on.prefix_of(*(torch.from_numpy(x) for x in (slots, kv_off, q_off))) == 3000
    for kind, name in ((SMALL, "qwen3-0.6b"), (LARGE, "qwen3-8b")):
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
        want = total - n * p + p * passes + partials if pays else total
        assert on.kv_read(kind, n, tokens, total, p) == want
        assert on.forward_s(kind, n, tokens, total, p) == on.costs[kind](n, tokens, want)
        assert off.kv_read(kind, n, tokens, total, p) == total
        assert off.forward_s(kind, n, tokens, total, p) == off.costs[kind](n, tokens, total)
        assert on.kv_read(kind, n, tokens, total, 0) == total  # P = 0: nothing shared
    # A prefix under MIN_SHARED_PREFIX, or one row, is not shared (P = 0).
    short = hand_built(MIN_SHARED_PREFIX - 1, own, [1] * len(own))
    assert on.prefix_of(*short) == 0
    assert on.prefix_of(*hand_built(300, own[:1], [1])) == 0


def test_shared_prefix_defaults_and_describe() -> None:
    """The runner being built (roofline) reads a shared prefix once, the measured one did
    not; fitted clocks default to not; describe() says which."""
    roof, measured = GpuClock(profile="h200-roofline"), GpuClock()
    assert roof.shared_prefix and not measured.shared_prefix
    assert "shared prefix read once" in roof.describe()
    assert "KV read per request" in measured.describe()
    assert not GpuClock(profile="h200-roofline", shared_prefix=False).shared_prefix
    assert GpuClock(shared_prefix=True).shared_prefix
    path = DATA / "h200-2026-11-30.json"
    assert not GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b").shared_prefix
    fitted = GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b", shared_prefix=True)
    assert fitted.shared_prefix and "shared prefix read once" in fitted.describe()


@st.composite
def shared_schedules(draw: Any) -> tuple[int, list[tuple[list[int], list[int], int]]]:
    """(U, forwards): each forward's rows (context, new tokens) and its P: 0, or at most U
    (no two rows share more than U slots) and at most every row's context before its new
    tokens, and at least MIN_SHARED_PREFIX (shared_prefix_len's rule); one-row forwards 0."""
    shareable = draw(st.integers(0, 20_000))
    forwards = []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 40))
        q = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
        kv = [qi + draw(st.integers(0, 30_000)) for qi in q]
        cap = min([shareable] + [k - qi for k, qi in zip(kv, q, strict=True)])
        p = draw(st.integers(0, max(0, cap))) if n >= 2 else 0
        forwards.append((kv, q, p if p >= MIN_SHARED_PREFIX else 0))
    return shareable, forwards


@pytest.mark.parametrize("profile", ["h200-2026-11-30", "h200-roofline"])
@pytest.mark.parametrize("shared", [False, True])
@settings(max_examples=200, deadline=None)
@given(sched=shared_schedules())
def test_floor_bounds_every_schedule_with_shared_reads(
    profile: str, shared: bool, sched: tuple[int, list[tuple[list[int], list[int], int]]]
) -> None:
    """The bench's ceiling with shared-prefix reads: however the rows are cut into forwards
    and whatever prefix each forward shares (at most the shareable one), the forwards cost at
    least floor_s of the tokens and least_kv_read of the rows."""
    shareable, forwards = sched
    clock = GpuClock(profile=profile, shared_prefix=shared)
    rows = sum(len(kv) for kv, _, _ in forwards)
    total_kv = sum(sum(kv) for kv, _, _ in forwards)
    total = sum(sum(q) for _, q, _ in forwards)
    for kind in (SMALL, LARGE):
        least = clock.least_kv_read(kind, total_kv, rows, shareable)
        assert 0 <= least <= total_kv
        paid = sum(clock.forward_s(kind, len(kv), sum(q), sum(kv), p) for kv, q, p in forwards)
        read = sum(clock.kv_read(kind, len(kv), sum(q), sum(kv), p) for kv, q, p in forwards)
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
    paid = clock.forward_s(kind, n, n, total_kv, shareable)
    least = clock.least_kv_read(kind, total_kv, n, shareable)
    assert least == total_kv - (n - passes) * shareable
    partials = clock.prefix_shapes[kind].overhead_slots(n)
    assert 0 < partials < shareable
    assert clock.floor_s(kind, n, least + partials) == pytest.approx(paid, rel=1e-12)
    for over in (least + shareable, total_kv):
        assert clock.floor_s(kind, n, over) > paid * (1 + 1e-9)


def _no_time() -> float:
    return 0.0


@pytest.mark.parametrize("dispatch", ["naive", "tokencache"])
def test_engine_prices_shared_prefixes_for_every_dispatch(pair: Any, dispatch: str) -> None:
    """Every dispatch is priced on the same runner: with shared_prefix the engine finds each
    forward's P (the primed prompt, shared by every row), the catch-ups record it, the clock
    runs ahead less, and the tokens are the same."""
    router = BernoulliRouter(0.3, seed=5)
    prompts = make_prompts(8, seed=11, shared=100)
    out = {}
    for shared in (False, True):
        clock = GpuClock(profile="h200-roofline", shared_prefix=shared)
        eng = RoutedEngine(*pair, router, 2048, clock=clock, dispatch=dispatch)
        for side in eng.sides:  # no host time: the clock is then a pure function of the schedule
            side.timer = _no_time
        eng.sched.router = ScriptedRouter(every=True)  # prime both trees, as the bench does
        eng.submit(prompts[0][:100], 1, route_key=-1).wait()
        eng.sched.router = router
        start = eng.stats.copy()
        res = eng.generate(prompts, 8)
        st = eng.stats.since(start)
        out[shared] = (res.tokens, st)
        assert eng.idle_invariant()
    (tok_off, st_off), (tok_on, st_on) = out[False], out[True]
    assert tok_on == tok_off
    assert set(st_off.catchup_shared_prefix) == {0}
    assert len(st_on.catchup_shared_prefix) == len(st_on.catchup_batch_sizes)
    pairs = zip(st_on.catchup_batch_sizes, st_on.catchup_shared_prefix, strict=True)
    shared_rows = [(b, p) for b, p in pairs if p]
    assert shared_rows and all(b >= 2 and p >= 100 for b, p in shared_rows)
    assert st_on.modeled_s < st_off.modeled_s
