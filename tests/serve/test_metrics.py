"""/metrics in Prometheus text format agrees with what clients got and with engine.metrics();
/health and /v1/models answer; one log line per request."""

from __future__ import annotations

import logging
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL, post_json, serve


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_match_responses(tiny: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokencache_serve")
    with serve(tiny) as served:
        c = served.client()
        prompt_tokens = completion = large = 0
        for i in range(4):
            r = c.completions.create(
                model=MODEL, prompt=[5 + i, 6, 7, 8], max_tokens=8, temperature=0
            )
            x = r.choices[0].model_extra["tokencache"]
            prompt_tokens += r.usage.prompt_tokens
            completion += r.usage.completion_tokens
            large += sum(x["large_token_mask"])
        chunks = list(
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "t1 t2 t3"}],
                max_tokens=5,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        prompt_tokens += usage.prompt_tokens
        completion += usage.completion_tokens
        large += sum(
            t
            for ch in chunks[1:-1]
            for t in ch.choices[0].model_extra["tokencache"]["large_token_mask"]
        )
        assert post_json(served.url, "/v1/completions", {"model": MODEL, "prompt": ""})[0] == 400
        served.wait_idle()

        m = scrape(served.url)
        eng = served.engine.metrics()

        def v(name: str, **labels: str) -> float:
            return m[(name, tuple(sorted(labels.items())))]

        finished = {
            dict(labels)["finish_reason"]: value
            for (name, labels), value in m.items()
            if name == "tokencache_requests_total" and dict(labels)["endpoint"] == "/v1/completions"
        }
        assert sum(finished.values()) == 4 and set(finished) <= {"length", "stop"}
        assert v("tokencache_http_requests_total", endpoint="/v1/completions", status="200") == 4
        assert v("tokencache_http_requests_total", endpoint="/v1/completions", status="400") == 1
        assert (
            v("tokencache_http_requests_total", endpoint="/v1/chat/completions", status="200") == 1
        )
        assert v("tokencache_prompt_tokens_total") == prompt_tokens
        assert v("tokencache_completion_tokens_total") == completion
        # the metric counts every generated token; the extension hides the eos that ended one
        stops = finished.get("stop", 0) + 1
        assert large <= v("tokencache_completion_tokens_large_total") <= large + stops
        assert v("tokencache_completion_tokens_large_total") == eng["tokens_large"]
        assert (
            v("tokencache_engine_tokens_generated_total") == eng["tokens_generated"] == completion
        )
        assert v("tokencache_engine_requests_submitted_total") == 5
        share = v("tokencache_escalation_share")
        assert 0.0 < share < 1.0
        assert share == pytest.approx(eng["escalations"] / eng["tokens_generated"])
        assert v("tokencache_engine_small_batch_occupancy") == eng["small_batch_occupancy"]
        assert 0.0 < v("tokencache_engine_bookkeeping_share") < 1.0
        for model in ("small", "large"):
            for state in ("used", "cached", "free"):
                assert (
                    v("tokencache_kv_slots", model=model, state=state)
                    == eng[f"{model}_kv_slots_{state}"]
                )
            assert v("tokencache_kv_slots", model=model, state="pinned") == 0
        assert v("tokencache_kv_slots", model="small", state="cached") > 0  # prompts stay cached
        assert v("tokencache_time_to_first_token_seconds_count") == 5
        assert v("tokencache_request_duration_seconds_count") == 6 - 1  # the 400 has no duration

        with urllib.request.urlopen(served.url + "/health", timeout=10) as r:
            assert r.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "tokencache_serve"]
    done = [x for x in lines if x.startswith("rid=")]
    assert len(done) == 5
    assert all("status=200" in x and "prompt=" in x and "large=" in x for x in done)
    assert any("-> 400 empty_prompt" in x for x in lines)
