"""The benchmark command runs end to end (tiny sizes) and prints its markdown table."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokencache_routing import bench


def test_bench_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    bench.main(
        [
            "--quick",
            "--rates",
            "0.2",
            "--batches",
            "4",
            "--shared-prompt",
            "8",
            "--max-new",
            "6",
            "--plot",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    systems = {r.split("|")[1].strip() for r in rows[1:]}
    assert systems == {
        "small alone",
        "large alone",
        "naive",
        "tokencache",
        "tokencache (threaded)",
    }
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.exists()
