"""The serving benchmark runs end to end (child-process server, both paths) at a tiny size."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokencache_serve.bench import main


def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    size = ["--requests", "6", "--concurrency", "3", "--max-new", "4", "--prompt-len", "8"]
    model = ["--hidden", "32", "--small-layers", "1", "--large-layers", "2"]
    rows = main([*size, *model, "--warmup", "0", "--json", str(out)])
    assert [r.path for r in rows] == ["in-process submit", "HTTP (SSE, child process)"]
    for r in rows:
        assert r.requests == 6 and r.requests_per_s > 0
        assert r.tokens_per_s == r.requests_per_s * 4  # no eos: every request makes 4 tokens
        assert math.isfinite(r.ttft_p50_ms) and r.ttft_p99_ms >= r.ttft_p50_ms
        assert math.isfinite(r.tpot_p50_ms) and r.tpot_p99_ms >= r.tpot_p50_ms
    assert [row["path"] for row in json.loads(out.read_text())] == [r.path for r in rows]
