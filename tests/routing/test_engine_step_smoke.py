"""benches/gpu/engine_step.py: --smoke runs its code paths on the CPU; without a GPU it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "gpu" / "engine_step.py"


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_smoke_times_the_engine_beside_the_runner_and_the_host_path() -> None:
    proc = _run(["--smoke"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # overlapped scheduling first (the target), then the serial path, one runner step for both
    assert [(r["check"], r["overlap"], r["target"]) for r in rows] == [
        ("engine step", True, True),
        ("engine step", False, False),
    ]
    assert rows[0]["runner_ms"] == rows[1]["runner_ms"]
    for row in rows:
        assert row["clean"], row  # every timed step a full decode batch, nothing escalated
        assert row["engine_ms"] > 0 and row["runner_ms"] > 0 and row["host_ms"] > 0
        assert row["engine_synced_ms"] > 0 and 0 < row["runner_device_ms"] <= row["runner_ms"]
        assert row["ratio"] == row["engine_ms"] / row["runner_ms"]
        assert row["ok"] == (row["ratio"] <= 1.2)
        assert row["device_ms"] > 0 and row["clock_ms"] > 0
        assert 0 <= row["device_idle_share"] <= 1 and 0 <= row["async_idle_share"] <= 1
        assert row["steps"] == [3, 3] and row["dropped_rows"] == 0
        assert row["runners_at_start"] == 0  # CPU: no graph runner (1 on CUDA)
        assert 0 < row["readback_ms"] < row["engine_ms"]  # the router and the tokens' read-back
    # serial: the engine clock charges host + device, and the device waits for all the host
    serial = rows[1]
    assert serial["clock_ms"] == pytest.approx(serial["host_ms"] + serial["device_ms"])
    assert serial["device_idle_share"] == pytest.approx(
        serial["host_ms"] / (serial["host_ms"] + serial["device_ms"])
    )
    assert "| 40 | 3 | on |" in proc.stdout and "| 40 | 3 | off |" in proc.stdout
    # then the host path (benches/host_path.py) on this CPU, overlap on and off
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert any(x.startswith("| decode | gpu | on |") and "| 3 | 40 |" in x for x in table)
    assert any(x.startswith("| decode | gpu | off |") and "| 3 | 40 |" in x for x in table)
    assert any(x.startswith("| catch-up | gpu |") and "| 10 | 40 |" in x for x in table)


def test_budget_skips_rows_and_the_host_path() -> None:
    proc = _run(["--smoke", "--budget-s", "0", "--overlap", "on", "--no-host-path"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows == [{"context": 40, "batch": 3, "overlap": True, "skipped": "time budget"}]
    assert "| decode |" not in proc.stdout


def test_refuses_without_a_gpu() -> None:
    proc = _run([])
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
