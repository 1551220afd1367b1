"""The clock checked against the GPU's rows: schedules read from the results, priced by hand
on a synthetic clock, the engine overhead recovered, the break-even rate solved, the shipped
profile beside the results it came from, and the refit clock within 25% of every warm routed
row the H200 measured."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from tokencache_routing.sim.clock import (
    DATA,
    MEASURED_PROFILES,
    EngineOverhead,
    GpuClock,
    overhead_path,
)
from tokencache_routing.sim.clock_check import (
    Check,
    ClockSource,
    Schedule,
    break_even,
    check,
    fit_overhead,
    price,
    refit,
    schedules,
)
from tokencache_routing.tools import clock_check
from tokencache_routing.tools.clock_check import DEFAULT_RESULTS, PROFILES

PROFILE = "h200-2026-12-04"
A, B, C, D = 0.004, 2e-5, 3e-4, 1e-8  # the synthetic fit: a + b*batch + c*new + d*kv


def synthetic_clock(tmp_path: Path) -> GpuClock:
    """A clock whose every forward of both models costs exactly a + b*batch + c*new + d*kv."""
    rows = []
    for model in ("qwen3-0.6b", "qwen3-8b"):
        for batch, new, ctx in [(1, 1, 512), (8, 8, 2048), (32, 32, 4096), (64, 64, 1024)]:
            rows.append({"model": model, "batch": batch, "new_tokens": new, "context": ctx,
                         "step_ms": 1e3 * (A + B * batch + C * new + D * batch * ctx)})  # fmt: skip
        for batch, new, ctx in [(1, 100, 512), (8, 800, 2048), (4, 40, 4096), (16, 64, 1024)]:
            rows.append({"model": model, "batch": batch, "new_tokens": new, "context": ctx,
                         "step_ms": 1e3 * (A + B * batch + C * new + D * batch * ctx)})  # fmt: skip
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps({"rows": rows}))
    return GpuClock.fit(path, "qwen3-0.6b", "qwen3-8b", shared_prefix=False)


def schedule(**kw: object) -> Schedule:
    base: dict[str, object] = dict(
        source="run.json", system="tokencache (serial)", workload="reasoning", p=0.1,
        small="qwen3-0.6b", large="qwen3-8b", context=1100, requests=4, tokens=400,
        unique_prompt=100, max_running=4, occupancy=1.0, small_steps=120, catchups=10,
        mean_catchup_batch=2.0, chunk=256, seconds=2.0, large_s=1.0, cold=False,
    )  # fmt: skip
    base.update(kw)
    return Schedule(**base)  # type: ignore[arg-type]


def cost(batch: float, new: float, kv: float) -> float:
    return A + B * batch + C * new + D * kv


def test_a_schedule_is_priced_as_its_forwards_one_after_another(tmp_path: Path) -> None:
    """4 requests of a 1000-token context (100 own + 900 shared) writing 100 tokens each:
    120 decode steps of 4 rows at the mean context 1050 (the shared prefix read per row: the
    synthetic clock does not read it once), 400 prompt tokens in 2 chunks of 200 (2 rows of
    100), 10 catch-ups of 2 rows each carrying (100 + 100) * 4 / 20 = 40 tokens a row."""
    clock = synthetic_clock(tmp_path)
    s = schedule()
    got = price(clock, s)
    assert got.decode_s == pytest.approx(120 * cost(4, 4, 4 * 1050), rel=1e-6)
    assert got.prefill_s == pytest.approx(2 * cost(2, 200, 200), rel=1e-6)
    assert got.catchup_s == pytest.approx(10 * cost(2, 80, 2 * 1050), rel=1e-6)
    assert got.seconds == pytest.approx(got.decode_s + got.prefill_s + got.catchup_s)
    alone = price(clock, dataclasses.replace(s, system="large alone", catchups=0))
    assert alone.catchup_s == 0.0 and alone.decode_s == got.decode_s  # same shapes, one model


def test_the_overhead_is_what_the_rows_spent_beyond_their_forwards(tmp_path: Path) -> None:
    """Rows that spent their priced forwards plus 7 ms per catch-up give back 7 ms; cold rows,
    bounds and rows without catch-ups are not fitted."""
    clock = synthetic_clock(tmp_path)
    rows = []
    for i, catchups in enumerate((10, 25, 40)):
        s = schedule(catchups=catchups, small_steps=100 + 10 * i)
        rows.append(dataclasses.replace(s, seconds=price(clock, s).seconds + 0.007 * catchups))
    noise = [
        dataclasses.replace(rows[0], cold=True, seconds=99.0),
        dataclasses.replace(rows[0], system="large alone", seconds=99.0),
    ]
    got = fit_overhead(clock, rows + noise)
    assert set(got) == {"qwen3-8b"}
    assert got["qwen3-8b"].multi_s == pytest.approx(0.007, rel=1e-6)
    assert got["qwen3-8b"].decode_s == 0.0
    # faster than the forwards: never a negative overhead
    fast = [dataclasses.replace(r, seconds=price(clock, r).seconds * 0.5) for r in rows]
    assert fit_overhead(clock, fast)["qwen3-8b"].multi_s == 0.0
    assert fit_overhead(clock, noise) == {}


def test_the_overhead_adds_to_each_forward_of_its_kind() -> None:
    plain = GpuClock(profile=PROFILE, engine_overhead=False)
    with_it = GpuClock(profile=PROFILE, engine_overhead=False).with_overhead(
        {"qwen3-8b": EngineOverhead(decode_s=0.001, multi_s=0.01)}
    )
    assert with_it.forward_s(1, 8, 80, 8000) == pytest.approx(
        plain.forward_s(1, 8, 80, 8000) + 0.01
    )
    assert with_it.forward_s(1, 8, 8, 8000) == pytest.approx(plain.forward_s(1, 8, 8, 8000) + 0.001)
    assert with_it.forward_s(0, 8, 8, 8000) == plain.forward_s(0, 8, 8, 8000)  # small untouched
    assert with_it.floor_s(1, 100, 0) == pytest.approx(plain.floor_s(1, 100, 0) + 0.001)


def test_break_even_is_where_routing_costs_the_large_model_alone(tmp_path: Path) -> None:
    clock = synthetic_clock(tmp_path)
    s = schedule(catchups=40)
    fixed = price(clock, s, catchups=1e-9).seconds  # p -> 0: every token still caught up
    at_p = price(clock, s).seconds
    target = (fixed + at_p) / 2  # between no catch-up and the row's own
    p_star = break_even(clock, s, target, s.p)
    assert p_star is not None and 0 < p_star < s.p
    assert price(clock, s, catchups=s.catchups * p_star / s.p).seconds == pytest.approx(target)
    assert break_even(clock, s, fixed * 0.9, s.p) is None  # routing loses even at p = 0
    assert break_even(clock, s, at_p * 1e3, s.p) == 1.0  # wins at any rate


def test_schedules_read_the_h200_rows_and_mark_the_cold_ones() -> None:
    rows = schedules(DEFAULT_RESULTS)
    by = {(r.source, r.system, r.context): r for r in rows if r.source == "routing_step.json"}
    # the first row at each context compiled its kernels inside its timed window
    assert by["routing_step.json", "tokencache", 8192].cold
    assert not by["routing_step.json", "tokencache (serial)", 8192].cold
    rerun = [r for r in rows if r.source == "routing_step-8192-warm-rerun.json"]
    assert [r.cold for r in rerun if r.system == "tokencache"] == [True, False]
    assert [r.cold for r in rerun if r.system == "large alone"] == [True, False]
    (big,) = [r for r in rows if r.large == "qwen3-32b"]
    assert big.small_steps == 2255 and big.catchups == 796 and big.tokens == 65536
    assert all(r.system.startswith("tokencache") or "alone" in r.system for r in rows)


def test_the_refit_clock_is_within_a_quarter_of_every_warm_routed_row() -> None:
    """The target the clock is held to: every warm routed row of the 0.6B + 8B run, priced by
    the isolated forwards plus the overhead fitted on the other rows of its workload."""
    results = [
        c
        for c in check(ClockSource(profile=PROFILE), schedules(DEFAULT_RESULTS))
        if isinstance(c, Check)
    ]
    warm = [c for c in results if c.schedule.routed and not c.schedule.cold]
    assert len(warm) >= 5
    for c in warm:
        err = Check.error(c.in_engine, c.schedule)
        assert err is not None and abs(err) <= 0.25, (c.schedule, err)
    # the isolated forwards alone are optimistic by far: the overhead is not decoration
    assert all((Check.error(c.isolated, c.schedule) or 0) > 0.3 for c in warm)
    skipped = [
        c
        for c in check(ClockSource(profile=PROFILE), schedules(DEFAULT_RESULTS))
        if isinstance(c, str)
    ]
    assert any("qwen3-32b" in c for c in skipped)  # no 32B forward was measured: not priced


def test_the_profile_lives_beside_the_results_it_came_from(tmp_path: Path) -> None:
    shipped = (DATA / f"{PROFILE}.json").read_bytes()
    assert shipped == (DEFAULT_RESULTS / "nvidia-h200-2026-12-04.json").read_bytes()
    assert overhead_path(PROFILE).read_text() == (DEFAULT_RESULTS / "engine.json").read_text()
    results = tmp_path / "results"
    shutil.copytree(DEFAULT_RESULTS, results)
    body = refit(ClockSource(profile=PROFILE), results, data=tmp_path)
    assert json.loads(overhead_path(PROFILE).read_text())["overhead"] == body["overhead"]
    assert (tmp_path / overhead_path(PROFILE).name).read_text() == (
        results / "engine.json"
    ).read_text()


def test_the_command_prints_the_check_and_the_break_even(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert PROFILES == MEASURED_PROFILES  # the command lists them without importing torch
    clock_check.main(["--break-even"])
    out = capsys.readouterr().out
    # the run's own forwards file prices it by default: the shipped profile is that file
    assert "clock: forwards of" in out and "nvidia-h200-2026-12-04.json" in out
    assert "| routing_step-reasoning.json | reasoning | tokencache (serial)" in out
    assert "p* (in-engine)" in out and "projection" in out
    assert "not priced" in out
    with pytest.raises(SystemExit):
        clock_check.main(["/nonexistent/results"])
    with pytest.raises(SystemExit, match="no serving rows"):
        clock_check.main([str(tmp_path)])
