"""benches/gpu/decode_step.py --smoke: every code path of the GPU bench, on the CPU (no timing
claims), so CI notices when the bench breaks before a GPU session does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benches" / "gpu" / "decode_step.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decode_step_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_run_writes_every_row_and_passes_its_checks(tmp_path: Path) -> None:
    bench = _bench()
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["smoke"] and result["device"] == "cpu-smoke"
    rows = result["rows"]
    decode = {(r["path"], r["batch"]) for r in rows if r["kind"] == "decode"}
    assert decode == {(p, b) for p in ("eager", "graphs", "torch", "unfused") for b in (1, 3, 4)}
    catchups = [r for r in rows if r["kind"] == "catch-up"]
    assert {(r["batch"], r["new_tokens"], r["context"]) for r in catchups} == {
        (2, 3, 40),
        (1, 5, 70),
    }
    # Every path times catch-ups, the graphs path through the multi-token runner.
    assert {r["path"] for r in catchups} == {"eager", "graphs", "torch", "unfused"}
    for r in rows:
        assert {"model", "path", "batch", "context", "step_ms"} <= set(r), r
        assert r["step_ms"] > 0 and r["bound_fraction"] > 0 and r["bound_ms"] > 0
    shared_rows = {
        (r["batch"], r["prompts"], r["path"]) for r in rows if r["kind"] == "shared decode"
    }
    assert shared_rows == {
        (b, k, p) for b, k in ((3, 1), (4, 2)) for p in ("graphs", "graphs-per-row")
    }
    graphs_check, *extend_checks, shared_check = result["checks"][:4]
    assert graphs_check["ok"] and graphs_check["greedy_tokens_identical"]
    assert graphs_check["max_abs_logit_diff"] <= 1e-4
    assert [c["check"] for c in extend_checks] == [
        "catch-up graphs vs eager, fp32, 3x4@30",
        "catch-up graphs vs eager, fp32, 1x20@40",
    ]
    assert all(c["ok"] and c["greedy_tokens_identical"] for c in extend_checks)
    assert "graphs vs graphs-per-row" in shared_check["check"] and shared_check["ok"]
    # The routing engine's GPU clock refits from this very file (as a GPU session would).
    from tokencache_routing import GpuClock

    clock = GpuClock.fit(out, "smoke", "smoke")
    assert clock.forward_s(0, 4, 4, 4 * 40) > 0 and clock.forward_s(1, 2, 6, 80) > 0


def test_catchup_spec_and_refusal_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.parse_catchups("10x10@8192, 2x3@40") == [(10, 10, 8192), (2, 3, 40)]
    assert bench.parse_shared("32x8192/160:4, 3x40/4") == [(32, 8192, 160, 4), (3, 40, 4, 1)]
    for bad in ("3x40/4:0", "3x40/41", "3x40"):
        with pytest.raises(ValueError):
            bench.parse_shared(bad)
    with pytest.raises(ValueError):
        bench.parse_catchups("10x10")
    with pytest.raises(ValueError):
        bench.parse_catchups("1x50@40")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the refusal path cannot be exercised")
    assert bench.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
