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
    assert rows and rows[0].startswith("| system | p | batch |"), res.stdout[-3000:]
    systems = {r.split("|")[1].strip() for r in rows[1:] if not r.startswith("|---")}
    assert {"small alone", "large alone", "naive", "tokencache"} <= systems
    result = json.loads((tmp_path / "routing_step.json").read_text())
    measured = [r for r in result["rows"] if "tokens_per_s" in r]
    assert not [r for r in result["rows"] if "error" in r]
    systems = {r["system"] for r in measured}
    assert systems >= {"small alone", "large alone", "naive", "tokencache"}
    # The threaded dispatch runs when the engine has mode="threaded", else it is skipped, said why.
    assert ("threaded" in systems) == (result["threaded_skipped"] is None)
    for r in measured:
        assert r["tokens"] == r["batch"] * result["max_new"]
        assert r["preemptions"] == 0 and r["idle_invariant"]
        if r["escalations"]:  # primed trees: a catch-up covers only generated tokens
            assert r["large_prefill_per_escalation"] <= result["max_new"]


def test_refuses_without_cuda(tmp_path: Path) -> None:
    res = _run([], tmp_path)
    assert res.returncode != 0
    assert "CUDA" in res.stderr
    assert not (tmp_path / "routing_step.json").exists()
