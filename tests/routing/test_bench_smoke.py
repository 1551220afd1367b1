"""The serving benchmark runs end to end at tiny sizes: table, JSON, every system idle after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokencache_routing import bench


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
    # The ceiling bounds every one-device schedule on the clock, the ideal included.
    ceiling = by["ceiling"]["tokens_per_s"]
    assert by["ideal"]["tokens_per_s"] <= ceiling
    assert by["tokencache"]["tokens_per_s"] <= ceiling and by["naive"]["tokens_per_s"] <= ceiling
