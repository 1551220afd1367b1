"""The gateway benchmark runs end to end at a tiny size: two fleets (cache-aware, round-robin),
the same trace, every request answered and counted by the replicas' own /metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gateway_helpers import require_smg

from tokencache_serve.gateway_bench import main


def test_gateway_bench_smoke(tmp_path: Path) -> None:
    require_smg()
    out = tmp_path / "gw.json"
    rows = main(["--quick", "--json", str(out)])
    assert [r.policy for r in rows] == ["cache_aware", "round_robin"]
    for r in rows:
        assert r.requests == 16 and sum(r.requests_per_replica) == 16
        assert 0 < r.prefix_hit_rate < 1  # repeats hit, first sightings cannot
        assert math.isfinite(r.ttft_p50_ms) and r.ttft_p99_ms >= r.ttft_p50_ms
    assert rows[1].requests_per_replica == [8, 8]  # round-robin alternates
    assert [row["policy"] for row in json.loads(out.read_text())] == ["cache_aware", "round_robin"]
