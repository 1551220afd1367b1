"""benches/gpu/engine_step.py: --smoke runs its code paths on the CPU; without a GPU it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    assert [r["check"] for r in rows] == ["engine step"]
    (row,) = rows
    assert row["engine_ms"] > 0 and row["runner_ms"] > 0 and row["host_ms"] > 0
    assert row["ratio"] == row["engine_ms"] / row["runner_ms"]
    assert (
        "| decode | gpu | on | 3 | 40 |" in proc.stdout
        and "| catch-up | gpu | on | 10 | 40 |" in proc.stdout
    )


def test_refuses_without_a_gpu() -> None:
    proc = _run([])
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
