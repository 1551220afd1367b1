"""benches/gpu/routing_step.py: --smoke runs its code path on CPU; without it, no CUDA = refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "gpu" / "routing_step.py"


def _run(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "integrations"), env.get("PYTHONPATH", "")) if p
    )
    env["OUT"] = str(out)
    env["HF_HUB_OFFLINE"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only, even on a GPU machine
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_smoke_prints_table(tmp_path: Path) -> None:
    res = _run(["--smoke"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert rows and rows[0].startswith("| L | p | system |"), res.stdout[-3000:]
    result = json.loads((tmp_path / "routing_step.json").read_text())
    assert not [r for r in result["rows"] if "error" in r]
    systems = {r["system"] for r in result["rows"]}
    assert systems == {"small alone", "large alone", "naive", "tokencache", "threaded"}
    for r in result["rows"]:
        # the fields the GPU clock is refitted from
        assert {"dispatch", "p", "batch", "context", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["requests"] * result["args"]["max_new"]
        assert r["tokens_per_s"] > 0


def test_smoke_reasoning_workload(tmp_path: Path) -> None:
    """--workload reasoning: one wave of long generations (here 24 tokens), the routed systems
    before the bounds, every request writing all its tokens, and the per-step breakdown."""
    res = _run(["--smoke", "--workload", "reasoning"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "paper ms" in res.stdout  # the breakdown beside the published profile
    result = json.loads((tmp_path / "routing_step.json").read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    assert [r["system"] for r in rows] == ["tokencache", "naive", "small alone", "large alone"]
    args = result["args"]
    assert (args["max_new"], args["requests_per_slot"], args["rates"]) == (24, 1, [0.2])
    for r in rows:
        assert r["workload"] == "reasoning" and r["context"] == 40 + 8 + 24
        assert r["requests"] == 4 and r["tokens"] == 4 * 24
        b = r["extra"]["breakdown"]
        assert abs(sum(b["ms_per_step"].values()) - b["step_ms"]) < 1e-9 * b["step_ms"]


def test_refuses_without_cuda(tmp_path: Path) -> None:
    res = _run([], tmp_path)
    assert res.returncode != 0
    assert "CUDA" in res.stderr
    assert not (tmp_path / "routing_step.json").exists()
