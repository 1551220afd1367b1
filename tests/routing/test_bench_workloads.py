"""The serving benchmark's named workloads, its concurrency sweep, output-length sweep and the
per-step breakdown (tokencache_routing.tools.bench_workloads): shapes, equal token counts across
systems, and a breakdown whose parts add up to the engine clock."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tokencache_routing.tools import bench, bench_rows
from tokencache_routing.tools.bench_workloads import PARTS, Sample, StepTrace

ROUTED = ("naive", "naive-sglang", "tokencache")


def test_workload_shapes() -> None:
    """Each workload's default shape, and --max-new / --contexts giving one point each."""
    (w,) = bench.parse_args(["--workload", "reasoning"]).points
    assert (w.shared, w.unique, w.max_new) == (128, 128, 2048)
    a = bench.parse_args(["--workload", "reasoning", "--max-new", "512", "2048", "8192"])
    assert [p.max_new for p in a.points] == [512, 2048, 8192]
    assert {(p.shared, p.unique) for p in a.points} == {(128, 128)}
    assert a.requests_per_slot == 1 and a.breakdown_steps == 128
    (w,) = bench.parse_args(["--workload", "long-input"]).points
    assert (w.prompt, w.shared, w.max_new) == (8192, 2048, 1024)
    # shared-prompt: today's default, the system prompt filling each context
    a = bench.parse_args([])
    assert [(p.shared, p.unique, p.max_new) for p in a.points] == [(1984, 32, 32), (8128, 32, 32)]
    assert a.requests_per_slot == 4 and a.breakdown_steps == 0 and a.concurrency == [32]
    a = bench.parse_args(
        ["--workload", "reasoning", "--concurrency", "1", "8", "--system-tokens", "64"]
    )
    assert a.concurrency == [1, 8] and a.points[0].shared == 64
    assert (
        "2048 new tokens per request (EOS-free)"
        in bench.parse_args(["--workload", "reasoning"]).points[0].describe()
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--concurrency", "0"])


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads((tmp_path / "bench.json").read_text())["rows"]
    return rows


def _check_breakdown(r: dict[str, Any]) -> None:
    """The parts of the per-step breakdown add up to the step; over a window that covers the
    whole run (quick runs have fewer than 128 steps), to the run's engine-clock time, and its
    large-forward part to the catch-ups as the clock priced them."""
    b = r["extra"]["breakdown"]
    assert b["steps"] == r["small_steps"] and b["first_step"] == 1
    ms = b["ms_per_step"]
    assert set(ms) == set(PARTS)
    assert all(ms[part] >= 0 for part in PARTS if part != "rest"), ms
    # rest = the clock less the parts. On a clock that charges only the trees the naive
    # dispatchers' tree work is all of it: rest 0; tokencache's admission hold-back check
    # matches outside any forward's host window (a measured match the clock does not charge),
    # so its rest may dip below 0 by that much. A clock charging more host time puts it here.
    assert ms["rest"] >= -ms["prefix match"] - 1e-12
    if r["system"] != "tokencache" and r["extra"]["host_charge"] == "trees":
        assert ms["rest"] == 0, ms
    assert math.isclose(sum(ms.values()), b["step_ms"], rel_tol=1e-9)
    assert math.isclose(sum(b["share"].values()), 1.0, rel_tol=1e-9)
    run_s = b["step_ms"] * b["steps"] / 1e3
    assert math.isclose(run_s, r["seconds"], rel_tol=1e-9)
    large_s = ms["large forward"] * b["steps"] / 1e3
    assert math.isclose(large_s, r["large_s"], rel_tol=1e-9, abs_tol=1e-12)
    assert ms["small forward"] > 0


def test_reasoning_concurrency_sweep(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["--quick", "--workload", "reasoning", "--concurrency", "1", "4"]
    args += ["--dispatches", *ROUTED, "--profile", "h200-roofline", "--out", str(tmp_path)]
    bench.main(args)
    out = capsys.readouterr().out
    # The report names its shape and says what the clock leaves out.
    assert "workload reasoning: 64-token shared system prompt + 8 own tokens, 48 new tokens" in out
    assert "host time" in out  # what the clock charges of the host's time, said
    assert "decode tok/s against concurrency" in out
    sweep = [x for x in out.splitlines() if x.startswith(("| 1 |", "| 4 |"))]
    assert len(sweep) == 4  # a row per concurrency in the tok/s and the latency tables
    assert "TTFT p50 / TPOT p50 / TPOT p99 / ITL p99" in out
    assert "paper ms" in out  # the breakdown beside the published profile
    rows = _rows(tmp_path)
    ran = {r["system"] for r in rows}
    assert {"small alone", "large alone", "naive", "tokencache"} <= ran
    for c in (1, 4):
        mine = [r for r in rows if r["max_running"] == c and r["system"] not in bench_rows.LIMITS]
        assert {r["system"] for r in mine} == ran - set(bench_rows.LIMITS)
        for r in mine:
            # EOS-free: every system writes every request's 48 tokens.
            assert r["requests"] == c and r["tokens"] == c * 48 and r["max_new"] == 48
            assert r["workload"] == "reasoning" and r["context"] == 64 + 8 + 48
            if r["system"] in ROUTED:
                _check_breakdown(r)
    sglang = [r for r in rows if r["system"] == "naive-sglang"]
    for r in sglang:  # SGLang's protocol: every hand-off matches, locks, inserts, unlocks
        ms = r["extra"]["breakdown"]["ms_per_step"]
        assert min(ms["tree insert/update"], ms["prefix match"], ms["lock"], ms["unlock"]) > 0
    if (tmp_path / "bench_concurrency.png").exists() is False:
        pytest.importorskip("matplotlib")
        raise AssertionError("matplotlib is installed but no concurrency plot was written")


def test_output_length_sweep(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["--quick", "--workload", "reasoning", "--max-new", "16", "48"]
    args += ["--dispatches", "naive", "tokencache", "--profile", "h200-roofline"]
    bench.main([*args, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "against output length" in out
    assert "tokencache: bookkeeping share at 48 new tokens / at 16" in out
    rows = _rows(tmp_path)
    for new in (16, 48):
        mine = [r for r in rows if r["max_new"] == new and r["system"] not in bench_rows.LIMITS]
        assert {r["tokens"] for r in mine} == {4 * new}  # --quick: 4 requests
        tc = next(r for r in mine if r["system"] == "tokencache")
        # the tree's cost per step over the generation, for the depth plot
        prof = tc["extra"]["per_step"]
        assert prof and prof[0][0] == 1 and prof[-1][1] == tc["small_steps"]
    if (tmp_path / "bench_length.png").exists() is False:
        pytest.importorskip("matplotlib")
        raise AssertionError("matplotlib is installed but no length plot was written")


def test_long_input_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["--quick", "--workload", "long-input", "--dispatches", "naive", "tokencache"]
    bench.main([*args, "--no-bounds", "--profile", "h200-roofline", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "workload long-input: 64-token shared system prompt + 160 own tokens" in out
    rows = _rows(tmp_path)
    assert {r["system"] for r in rows} == {"naive", "tokencache"}
    assert {r["tokens"] for r in rows} == {4 * 12}
    assert {r["context"] for r in rows} == {64 + 160 + 12}


class _Side:
    def __init__(self) -> None:
        self.bookkeeping_by_op: dict[str, float] = {}


def test_breakdown_window_by_hand() -> None:
    """The window holds the last K small steps (the catch-up run before the first of them
    included); the parts map the tree's operations as published (a cursor's extend is its
    insert/update), and the rest is what the clock charged beyond them."""
    trace = StepTrace.__new__(StepTrace)
    trace.samples = [
        Sample(0, 0.0, 0.0, 0.0, {}),
        Sample(1, 1.0, 0.5, 0.4, {"match": 0.1}),
        Sample(2, 3.0, 1.0, 2.0, {"match": 0.1, "extend": 0.3, "insert": 0.2}),
        # a catch-up on its own (no small step): it runs before step 3
        Sample(2, 4.0, 1.0, 2.9, {"match": 0.1, "extend": 0.3, "insert": 0.2, "evict": 0.1}),
        Sample(3, 5.1, 1.5, 2.9, {"match": 0.2, "extend": 0.6, "insert": 0.2, "evict": 0.2}),
    ]
    trace.samples[-1].ops.update(lock=0.1, unlock=0.1)
    b = trace.breakdown(1)  # step 3, and the catch-up before it
    assert (b.steps, b.first_step) == (1, 3) and math.isclose(b.total, 2.1)
    want = {"small forward": 0.5, "large forward": 0.9, "tree insert/update": 0.3,
            "prefix match": 0.1, "lock": 0.1, "unlock": 0.1, "rest": 0.1}  # fmt: skip
    for part, v in want.items():  # rest: the evictions (what the clock charged beyond)
        assert math.isclose(b.parts[part], v, abs_tol=1e-12), part
    assert math.isclose(b.ms("lock"), 100.0) and math.isclose(b.share("rest"), 0.1 / 2.1)
    b = trace.breakdown(2)
    assert (b.steps, b.first_step) == (2, 2) and math.isclose(b.total, 4.1)
    assert math.isclose(b.parts["tree insert/update"], 0.8)  # extend 0.6 + insert 0.2
    assert math.isclose(sum(b.parts.values()), b.total)
    b = trace.breakdown(128)  # more than the run: all of it
    assert (b.steps, b.first_step) == (3, 1) and math.isclose(b.total, 5.1)
    assert math.isclose(b.parts["tree insert/update"], 0.8)


def test_from_json_merges_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One run per output length, reported together: the length table over both, the limits
    recomputed once, the JSON's rows those of both runs."""
    for new in (16, 32):
        args = ["--quick", "--workload", "reasoning", "--max-new", str(new)]
        args += ["--dispatches", "naive", "tokencache", "--profile", "h200-roofline"]
        bench.main([*args, "--out", str(tmp_path / str(new))])
    capsys.readouterr()
    files = [str(tmp_path / str(new) / "bench.json") for new in (16, 32)]
    bench.main(["--from-json", *files, "--out", str(tmp_path / "both")])
    out = capsys.readouterr().out
    assert "against output length" in out
    assert out.count("workload reasoning: 64-token shared system prompt") == 2
    rows = _rows(tmp_path / "both")
    for new in (16, 32):
        mine = [r for r in rows if r["max_new"] == new]
        assert sorted(r["system"] for r in mine) == sorted(
            ["small alone", "large alone", "naive", "tokencache", "ceiling", "ideal"]
        )


def test_tpot_is_per_request_and_itl_per_token(tmp_path: Path) -> None:
    """TPOT as the serving benchmarks define it (per request: (last - first) / (n - 1), its
    percentiles over requests) beside ITL (every gap between two tokens); every row of an older
    run, whose "tpot" columns were the gaps, loads with them as ITL and its TPOT unknown."""
    args = ["--quick", "--workload", "reasoning", "--max-new", "16", "--no-bounds"]
    bench.main([*args, "--dispatches", "tokencache", "--profile", "h200-roofline",
                "--out", str(tmp_path / "new")])  # fmt: skip
    (row,) = _rows(tmp_path / "new")
    assert (
        0 < row["itl_p50_ms"] <= row["itl_p99_ms"] and 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
    )
    assert row["tpot_p50_ms"] != row["itl_p50_ms"]  # two different figures
    old = dict(row)
    old["tpot_p50_ms"], old["tpot_p99_ms"] = old.pop("itl_p50_ms"), old.pop("itl_p99_ms")
    old["extra"] = {f"tpot_small_{k[len('itl_small_'):]}" if k.startswith("itl_small_") else k: v
                    for k, v in row["extra"].items()}  # fmt: skip
    data = json.loads((tmp_path / "new" / "bench.json").read_text())
    data["rows"] = [old]
    (tmp_path / "old.json").write_text(json.dumps(data))
    (loaded,), _ = bench_rows.load_rows([str(tmp_path / "old.json")])
    assert (loaded.itl_p50_ms, loaded.itl_p99_ms) == (row["itl_p50_ms"], row["itl_p99_ms"])
    assert math.isnan(loaded.tpot_p50_ms) and math.isnan(loaded.tpot_p99_ms)
    assert loaded.extra["itl_small_p99_ms"] == row["extra"]["itl_small_p99_ms"]


def test_arrival_times_are_a_seeded_poisson_schedule() -> None:
    """--arrival-rate: the first request at 0, exponential gaps of mean 1 / rate, one seed one
    schedule; rate 0 is the historical all-at-once shape; a bad rate is refused."""
    from tokencache_routing.tools.bench_workloads import arrival_times

    assert arrival_times(4, 0.0, 0) == [0.0] * 4
    t = arrival_times(2000, 50.0, 7)
    assert t[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(t))
    assert t == arrival_times(2000, 50.0, 7) and t != arrival_times(2000, 50.0, 8)
    assert t[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)  # mean gap
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="arrival rate"):
            arrival_times(3, bad, 0)
    with pytest.raises(SystemExit):
        bench.parse_args(["--arrival-rate", "-2"])


def test_staggered_arrivals_land_prefills_among_decoding_rows(tmp_path: Path) -> None:
    """A request submitted with a later arrival_s is admitted no sooner and its TTFT counts
    from it; in the bench the late requests' prefills meet decoding rows (the first request's
    tokens straddle the last arrival)."""
    args = ["--quick", "--workload", "long-input", "--dispatches", "tokencache", "--no-bounds"]
    bench.main([*args, "--arrival-rate", "100", "--profile", "h200-roofline",
                "--out", str(tmp_path)])  # fmt: skip
    (row,) = _rows(tmp_path)
    assert row["extra"]["arrival_rate"] == 100 and row["tokens"] == 4 * 12

    from routing_helpers import make_prompts, tiny_config

    from tokencache_models import random_model
    from tokencache_routing import EngineConfig, RoutedEngine, ScriptedRouter

    small = random_model(tiny_config(1), seed=1, attention_backend="torch").eval()
    large = random_model(tiny_config(2), seed=2, attention_backend="torch").eval()
    eng = RoutedEngine(
        small, large, ScriptedRouter(), config=EngineConfig(num_slots=512, clock="steps")
    )
    p = make_prompts(2, seed=5)
    first = eng.submit(p[0], 10)
    late = eng.submit(p[1], 4, arrival_s=5.0)
    while eng.iterate():
        pass
    assert late.submitted_at == 5.0 and late.token_times[0] > 5.0
    assert first.token_times[0] < 5.0 < first.token_times[-1]  # it arrived mid-decode
    with pytest.raises(ValueError, match="arrival_s"):
        eng.submit(p[0], 2, arrival_s=float("nan"))
