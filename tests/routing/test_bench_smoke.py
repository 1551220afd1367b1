"""The serving benchmark runs end to end at tiny sizes: table, JSON, every system idle after."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokencache_routing.tools import bench, bench_prompts


@pytest.mark.parametrize("profile", ["h200-2026-11-30", "h200-roofline"])
def test_bench_runs_on_the_gpu_clock(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, profile: str
) -> None:
    args = ["--quick", "--dispatches", "naive", "tokencache", "threaded"]
    bench.main([*args, "--profile", profile, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"clock: gpu:{profile}" in out
    # The report says whether the modelled runner reads a shared prefix once (the roofline's
    # runner does, the measured one did not).
    mode = "shared prefix read once" if profile == "h200-roofline" else "KV read per request"
    (line,) = [x for x in out.splitlines() if x.startswith("clock: ")]
    assert mode in line
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    systems = {r.split("|")[3].strip() for r in rows[1:]}
    assert systems == {
        *("small alone", "large alone", "ceiling", "ideal", "naive", "tokencache", "threaded")
    }
    data = json.loads((tmp_path / "bench.json").read_text())
    by = {r["system"]: r for r in data["rows"]}
    n = 2 * 4  # --quick: 2 x max_running requests of 8 new tokens
    for name in ("naive", "tokencache", "threaded", "small alone", "large alone"):
        assert by[name]["requests"] == n and by[name]["tokens"] == n * 8
        assert by[name]["tokens_per_s"] > 0
    assert by["threaded"]["clock"] == "wall (this CPU)"
    assert by["tokencache"]["extra"]["shared_prefix"] is (profile == "h200-roofline")
    assert mode in by["tokencache"]["clock"] and mode in by["naive"]["clock"]
    assert 0 < by["tokencache"]["occupancy"] <= 1
    # Host time per small step and the GPU's idle share beside it (event-loop rows: the engine
    # measures its host path; threaded rows are wall time and report none).
    for name in ("naive", "tokencache", "small alone"):
        assert by[name]["host_ms_per_small_step"] > 0 and 0 < by[name]["gpu_idle_share"] < 1
    assert by["threaded"]["host_ms_per_small_step"] == 0
    # The ceiling bounds every one-device schedule on the clock, the ideal included.
    ceiling = by["ceiling"]["tokens_per_s"]
    assert by["ideal"]["tokens_per_s"] <= ceiling
    assert by["tokencache"]["tokens_per_s"] <= ceiling and by["naive"]["tokens_per_s"] <= ceiling


def test_make_prompts_draws_k_system_prompts_round_robin() -> None:
    """K = 1 is the historical workload (one base drawn first, then each request's own
    tokens, from one seeded generator); K prompts: request i on prompt i mod K, the first
    prompt the historical one, all K distinct."""
    n, shared, unique, vocab, seed = 7, 90, 5, 512, 3
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, shared).tolist()
    historical = [base + rng.integers(0, vocab, unique).tolist() for _ in range(n)]
    assert bench_prompts.make_prompts(n, shared, unique, vocab, seed) == historical
    assert bench_prompts.make_prompts(n, shared, unique, vocab, seed, 1) == historical
    k = 3
    prompts = bench_prompts.make_prompts(n, shared, unique, vocab, seed, k)
    systems = bench_prompts.system_prompts_of(prompts, shared)
    assert len(systems) == k and systems[0] == base
    for i, q in enumerate(prompts):
        assert len(q) == shared + unique and q[:shared] == systems[i % k]
    assert bench_prompts.longest_common_prefix(systems) < shared  # K distinct prompts
    assert bench_prompts.longest_common_prefix(prompts) >= shared
    with pytest.raises(ValueError, match="system_prompts"):
        bench_prompts.make_prompts(n, shared, unique, vocab, seed, 0)


def test_bench_runs_on_several_system_prompts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--system-prompts 2: the report says so, every prompt is primed and shared, and the
    ceiling (least_kv_read over rows of both prompts) still bounds every system."""
    args = ["--quick", "--dispatches", "naive", "tokencache", "--system-prompts", "2"]
    bench.main([*args, "--profile", "h200-roofline", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("clock: ")]
    assert "2 system prompts" in line
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["args"]["system_prompts"] == 2
    by = {r["system"]: r for r in data["rows"]}
    for name in ("naive", "tokencache"):
        extra = by[name]["extra"]
        assert extra["system_prompts"] == 2
        assert by[name]["tokens"] == 2 * 4 * 8
        # --quick: 96-token contexts, 8 own prompt tokens and 8 new: 80-token system prompts
        assert extra["shareable_prefix"] >= 80
        assert extra["catchup_kv_floor"] <= extra["catchup_kv_read"] <= extra["catchup_kv_context"]
    ceiling = by["ceiling"]["tokens_per_s"]
    assert by["ideal"]["tokens_per_s"] <= ceiling
    assert by["tokencache"]["tokens_per_s"] <= ceiling and by["naive"]["tokens_per_s"] <= ceiling


def test_bench_prices_a_tensor_parallel_large_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--large-tp 2: the same schedule (the CPU computes the same tokens), the large model's
    forwards priced on 2 GPUs (tp_cost): 'large alone' and the catch-ups cost less than at
    TP=1, more than half of it; 'small alone' is unchanged; the clock line names the source."""
    args = ["--quick", "--profile", "h200-roofline", "--large-shape", "qwen3-32b"]
    args += ["--dispatches", "tokencache"]
    rows = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        bench.main([*args, "--large-tp", str(tp), "--out", str(out)])
        data = json.loads((out / "bench.json").read_text())
        rows[tp] = {r["system"]: r for r in data["rows"]}
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("clock: ")][-1]
    assert "large tp=2" in line and "900 GB/s" in line and "nvidia.com" in line
    one, two = rows[1], rows[2]
    assert two["small alone"]["clock"] == one["small alone"]["clock"]  # priced as before
    assert "tp=2" in two["large alone"]["clock"] and "tp=2" not in one["large alone"]["clock"]
    for system in ("large alone", "tokencache"):
        assert two[system]["tokens"] == one[system]["tokens"]
    assert 1.0 < one["large alone"]["seconds"] / two["large alone"]["seconds"] < 2.0
    assert 1.0 < one["tokencache"]["large_s"] / two["tokencache"]["large_s"] < 2.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--large-tp", "2"])  # the measured profile is one GPU's fit


def test_stub_device_keeps_the_schedule(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--stub-device times the host path without the CPU models' forwards: the Bernoulli router
    and the EOS-free lengths ignore the logits, so every system runs the same schedule (small
    steps, catch-ups and their sizes, tokens) as with the real forwards, whichever runner's host
    preparation they get (--stub-runner); the report says so.
    Clock-only: refused with the measured clock or threaded rows (their time is wall time)."""
    args = ["--quick", "--profile", "h200-roofline", "--dispatches", "naive", "tokencache"]
    by: dict[str, dict[str, dict[str, object]]] = {}
    for stub in ("", "gpu", "eager"):  # not stubbed; the GPU's host path (default); this CPU's
        out = tmp_path / (stub or "real")
        flags = ["--stub-device", *(["--stub-runner", stub] if stub == "eager" else [])]
        bench.main([*args, "--out", str(out), *(flags if stub else [])])
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("clock: "))
        assert ("device work stubbed" in line) is bool(stub)
        assert (f"{stub} runner" in line) is bool(stub)
        rows = json.loads((out / "bench.json").read_text())["rows"]
        by[stub] = {r["system"]: r for r in rows}
    keys = ("requests", "tokens", "small_steps", "catchups", "mean_catchup_batch")
    for system in ("naive", "tokencache", "small alone", "large alone"):
        for stub in ("gpu", "eager"):
            assert {k: by[stub][system][k] for k in keys} == {k: by[""][system][k] for k in keys}
    for bad in (["--clock", "measured"], ["--dispatches", "threaded"]):
        with pytest.raises(SystemExit):
            bench.main(["--quick", "--stub-device", *bad, "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit):  # a host path for stubbed models, without the stub
        bench.main(["--quick", "--stub-runner", "eager", "--out", str(tmp_path / "x")])


def test_serving_phases_times_each_phase_and_puts_it_back(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benches/serving_phases.py: the serving benchmark with the scheduler's phases timed, a
    row each (catch-ups included), the device's waits by the launch they were for, and the
    scheduler and event loop as they were afterwards."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benches"))
    import serving_phases

    from tokencache_routing.drivers import events

    before = [getattr(owner, name) for _, owner, name in serving_phases.PHASES]
    start_on_device = events.EventLoop._start_on_device
    args = ["--quick", "--profile", "h200-roofline", "--dispatches", "tokencache"]
    spent = serving_phases.main([*args, "--stub-device", "--out", str(tmp_path)])
    assert [getattr(owner, name) for _, owner, name in serving_phases.PHASES] == before
    for label, _, _ in serving_phases.PHASES:
        calls, seconds = spent[label]
        assert calls >= 1 and seconds >= 0, label
    assert spent["schedule_large"][0] == spent["  take_catchup_batch"][0]
    assert events.EventLoop._start_on_device is start_on_device
    before_catchup, after_catchup, other = (spent[c] for c in serving_phases.IDLE)
    assert before_catchup[0] == spent["schedule_large"][0]  # every catch-up launched
    assert 1 <= after_catchup[0] <= before_catchup[0] and other[0] >= 1
    assert min(before_catchup[1], after_catchup[1], other[1]) >= 0
    out = capsys.readouterr().out
    assert "| phase | calls | ms in all | ms a call |" in out
    assert "| device waited | launches | ms in all |" in out
