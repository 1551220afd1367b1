"""The GPU cost clock: fitted to the measurements it ships with, exact on synthetic data, and it
prices schedules without changing tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_helpers import make_prompts
from test_exactness import bernoulli_decide

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
