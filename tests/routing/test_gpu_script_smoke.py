"""benches/gpu: routing_step.py and run_all.sh rehearsed on the CPU.

`GPU_SMOKE=1 bash benches/gpu/run_all.sh all` runs the one device call's four parts (decode,
engine, routing shared-prompt, routing reasoning) with --smoke (tiny models on the CPU): the
same code paths, file names and order as on the H200. Without --smoke and without CUDA each
script refuses, and every part still runs after the one before failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benches" / "gpu"
SCRIPT = GPU / "routing_step.py"
PARTS = [
    "decode",
    "routing reasoning",
    "routing reasoning-32b",
    "warm",
    "engine",
    "routing shared-prompt",
    "clock check",
]
MARKDOWN = (
    "decode_step",
    "routing_step-reasoning",
    "routing_step-reasoning-32b",
    "warm_start",
    "engine_step",
    "routing_step",
    "clock_check",
)
# run_all.sh runs the four scripts in a subprocess under its own 600 s limit: that one, not
# pytest-timeout's 300 s default, is to fail first (with the scripts' output).
pytestmark = pytest.mark.timeout(900)


def _env(out: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "integrations"), env.get("PYTHONPATH", "")) if p
    )
    env |= {"OUT": str(out), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU only
    env["PYTHON"] = sys.executable
    return env | extra


def _run_all(out: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(GPU / "run_all.sh"), "all"],
        cwd=ROOT,
        env=_env(out, GPU_RESULTS=str(out / "results"), **extra),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _stamps(out: Path) -> list[str]:
    log = (out / "run_all.log").read_text().splitlines()
    return [line.split(": ", 1)[1].split(" (")[0].split(" at ")[0] for line in log]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpu-smoke")
    res = _run_all(out, GPU_SMOKE="1")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return out, res.stdout


def _rows(out: Path, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result = json.loads((out / name).read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r or "skipped" in r], rows
    return result, rows


def test_run_all_runs_every_part_in_order(smoke: tuple[Path, str]) -> None:
    out, stdout = smoke
    assert _stamps(out) == [*PARTS, "done"]
    for md in MARKDOWN:
        assert (out / f"{md}.md").read_text().strip(), md
    # routing's named files, written into $OUT's results directory (GPU_RESULTS) as well
    names = sorted(p.name for p in (out / "results").glob("*-routing*.json"))
    tags = [n.rsplit("-routing", 1)[1] for n in names]
    assert tags == ["-reasoning-32b.json", "-reasoning.json", ".json"], names
    warm = [json.loads(x) for x in (out / "warm_start.md").read_text().splitlines() if x[:1] == "{"]
    assert [r["check"] for r in warm] == [
        "warm-up (first)",
        "warm-up (again)",
        "requests after warm-up",
        "cold engine, first request",
    ]
    assert warm[2]["cold_runs"] == 0 and warm[0]["keys"] > 0
    # the engine's rows: overlap on (the target) then off, beside the runner's step
    engine = [
        json.loads(x) for x in (out / "engine_step.md").read_text().splitlines() if x[:1] == "{"
    ]
    assert [(r["check"], r["overlap"]) for r in engine] == [
        ("engine step", True),
        ("engine step", False),
    ]
    assert "| 40 | 3 | on |" in stdout and "| 40 | 3 | off |" in stdout


def test_smoke_shared_prompt_rows(smoke: tuple[Path, str]) -> None:
    out, stdout = smoke
    rows = [line for line in stdout.splitlines() if line.startswith("| L | p | system |")]
    assert rows, stdout[-3000:]
    result, rows = _rows(out, "routing_step.json")
    # target first: tokencache beside the large model alone and naive, then tokencache
    # without overlap, then the others
    assert [r["system"] for r in rows] == [
        "tokencache",
        "large alone",
        "naive",
        "tokencache (serial)",
        "threaded",
        "small alone",
    ]
    for r in rows:
        # the fields the GPU clock is refitted from
        assert {"dispatch", "overlap", "p", "batch", "context", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["requests"] * result["args"]["max_new"]
        assert r["tokens_per_s"] > 0
    overlap = {r["system"]: (r["dispatch"], r["overlap"]) for r in rows}
    assert overlap["tokencache"] == ("tokencache", True)
    assert overlap["tokencache (serial)"] == ("tokencache", False)
    assert overlap["naive"] == ("naive", False)


def test_smoke_reasoning_workload(smoke: tuple[Path, str]) -> None:
    """--workload reasoning: one wave of long generations (here 24 tokens), tokencache beside
    the large model alone, then without overlap and the small model alone, every request
    writing all its tokens, and the per-step breakdown; the Qwen3-32B pair's rows in files of
    their own."""
    out, stdout = smoke
    assert "paper ms" in stdout  # the breakdown beside the published profile
    result, rows = _rows(out, "routing_step-reasoning.json")
    order = [
        ("tokencache", True),
        ("large alone", True),
        ("tokencache (serial)", False),
        ("small alone", True),
    ]
    assert [(r["system"], r["overlap"]) for r in rows] == order
    big, big_rows = _rows(out, "routing_step-reasoning-32b.json")
    assert big["large"] == "qwen3-32b" and [(r["system"], r["overlap"]) for r in big_rows] == order
    args = result["args"]
    assert (args["max_new"], args["requests_per_slot"], args["rates"]) == (24, 1, [0.2])
    for r in rows:
        assert r["workload"] == "reasoning" and r["context"] == 40 + 8 + 24
        assert r["requests"] == 4 and r["tokens"] == 4 * 24
        b = r["extra"]["breakdown"]
        assert abs(sum(b["ms_per_step"].values()) - b["step_ms"]) < 1e-9 * b["step_ms"]


def test_device_order_targets_first() -> None:
    """The H200 order (not run here): tokencache first, the large model alone right after it
    (the headline ratio), then the target baseline, the serial tokencache row, the other
    dispatches; the other bounds after every routed row at p = 0.1."""
    sys.path.insert(0, str(GPU))
    import routing_step

    def order(argv: list[str]) -> list[tuple[int, float, str, bool | None]]:
        a = routing_step.parse_args(argv)
        if a.system_tokens is not None:
            a.contexts = [a.system_tokens + a.unique_prompt + a.max_new]
        return routing_step.plan(a)

    shared = order(["--contexts", "8192", "2048", "--rates", "0.1"])
    assert shared[:6] == [
        (8192, 0.1, "tokencache", None),
        (8192, 0.0, "large alone", None),
        (8192, 0.1, "naive", None),
        (8192, 0.1, "tokencache", False),
        (8192, 0.1, "naive-sglang", None),
        (8192, 0.1, "threaded", None),
    ]
    assert shared[6][:3] == (2048, 0.1, "tokencache") and len(shared) == 14
    assert shared[7][2] == "large alone"
    assert [s for _, _, s, _ in shared[-2:]] == ["small alone"] * 2
    reasoning = order(["--workload", "reasoning"])
    assert [(c, s, o) for c, _, s, o in reasoning] == [
        (2304, "tokencache", None),
        (2304, "large alone", None),
        (2304, "naive-sglang", None),
        (2304, "tokencache", False),
        (2304, "naive", None),
        (2304, "small alone", None),
    ]
    late = order(["--workload", "reasoning", "--no-large-alone-first"])
    assert [s for _, _, s, _ in late][-2:] == ["small alone", "large alone"]
    on = order(["--workload", "reasoning", "--overlap", "on"])
    off = order(["--workload", "reasoning", "--overlap", "off"])
    assert [o for _, _, s, o in on if s == "tokencache"] == [None]
    assert [o for _, _, s, o in off if s == "tokencache"] == [False]
    assert off[2][2] == "naive-sglang"


def test_each_part_runs_after_a_failure_and_refuses_without_cuda(tmp_path: Path) -> None:
    res = _run_all(tmp_path)
    assert res.returncode != 0
    assert _stamps(tmp_path) == [*PARTS, "done"]
    *gpu_parts, clock = MARKDOWN
    for md in gpu_parts:
        assert "CUDA" in (tmp_path / f"{md}.md").read_text(), md
    assert "no serving rows" in (tmp_path / f"{clock}.md").read_text()
    assert not list(tmp_path.glob("*.json"))
