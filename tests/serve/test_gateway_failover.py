"""A replica killed (SIGKILL) mid-load behind SGLang Model Gateway: every request still gets an
answer, none sent after the crash is lost (the gateway retries on the survivor), and the
survivor keeps serving. 127.0.0.1 only; the fleet is stopped whatever happens."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from gateway_helpers import MODEL, dump_logs, make_fleet, metric_sum, metrics_text, require_smg

from tokencache_serve.replicas import Fleet, get_json


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    require_smg()
    f = make_fleet(2, tmp_path)
    try:
        with f:
            f.start(timeout_s=180)
            yield f
    except BaseException:
        dump_logs(tmp_path)
        raise


def running(url: str) -> int:
    try:
        return int(get_json(url + "/v1/loads", timeout=2)["loads"][0]["num_running_reqs"])
    except OSError:
        return 0


def test_killing_a_replica_mid_load_loses_no_request(fleet: Fleet) -> None:
    import openai

    assert fleet.gateway_url is not None
    client = openai.OpenAI(
        base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    results: dict[int, tuple[str, Any]] = {}
    killed_at: list[float] = []
    sent_at: dict[int, float] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        with lock:
            sent_at[i] = time.monotonic()
        try:
            r = client.completions.create(
                model=MODEL, prompt=f"t{i % 80} t{(i * 7) % 80} t3 t4", max_tokens=48
            )
            results[i] = ("ok", r.choices[0].finish_reason)
        except openai.APIStatusError as e:
            results[i] = ("status", e.status_code)
        except openai.APIError as e:
            results[i] = ("error", type(e).__name__)

    n = 32
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        deadline = time.monotonic() + 60
        # kill replica 0 while it is decoding requests (not before the load reaches it)
        while running(fleet.replica_urls[0]) == 0:
            assert time.monotonic() < deadline, "replica 0 never got a request"
            time.sleep(0.01)
        fleet.kill_replica(0)
        killed_at.append(time.monotonic())
        for fut in futures:
            fut.result(timeout=180)  # no request hangs
    assert len(results) == n
    after = [i for i in range(n) if sent_at[i] > killed_at[0]]
    assert after, "every request was sent before the kill: nothing tested"
    lost = {i: results[i] for i in range(n) if results[i][0] != "ok"}
    # requests sent after the crash: all answered (retried on the survivor); the tiny model's
    # eos may end one before max_tokens
    assert all(results[i][0] == "ok" for i in after), {i: results[i] for i in after}
    # in flight at the crash: the gateway retries them too (smg buffers a request body to
    # retry it; a non-streamed response is not started until it is complete)
    assert not lost, lost
    survivor = fleet.replica_urls[1]
    before = metric_sum(metrics_text(survivor), "tokencache_requests_total")
    for i in range(4):
        r = client.completions.create(model=MODEL, prompt=f"t{i} t9", max_tokens=4)
        assert r.usage.completion_tokens == 4
    assert metric_sum(metrics_text(survivor), "tokencache_requests_total") == before + 4


def test_api_key_through_the_gateway(tmp_path: Path) -> None:
    """Replicas with --api-key: smg given the same key probes them with it and requires it of
    its own clients (a wrong or missing key: 401 at the gateway)."""
    import openai
    from gateway_helpers import GATEWAY_ARGS, REPLICA_ARGS
    from serve_helpers import post_json

    require_smg()
    key = "k-3f1e"
    f = make_fleet(
        1,
        tmp_path,
        replica_args=(*REPLICA_ARGS, "--api-key", key),
        gateway_args=(*GATEWAY_ARGS, "--api-key", key),
    )
    f.api_key = key
    try:
        with f:
            f.start(timeout_s=180)
            assert f.gateway_url is not None
            body = {"model": MODEL, "prompt": "t1", "max_tokens": 2}
            assert post_json(f.gateway_url, "/v1/completions", body)[0] == 401  # no key
            c = openai.OpenAI(base_url=f.gateway_url + "/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                c.completions.create(model=MODEL, prompt="t1", max_tokens=2)
            c = openai.OpenAI(base_url=f.gateway_url + "/v1", api_key=key, max_retries=0)
            r = c.completions.create(model=MODEL, prompt="t1 t2", max_tokens=2)
            assert r.choices[0].text
    except BaseException:
        dump_logs(tmp_path)
        raise


def test_a_stream_cut_by_a_crash_ends_with_an_error(fleet: Fleet) -> None:
    """A started stream cannot be replayed on another worker: the client gets smg's error event
    (the openai client raises), never a silently truncated answer, and no hang."""
    import openai

    assert fleet.gateway_url is not None
    client = openai.OpenAI(
        base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60
    )
    prompt = "t0 t0 t3 t4"  # greedy, 83 tokens before the tiny model's eos
    out: dict[str, Any] = {"chunks": 0, "finish": None, "error": None}

    def stream() -> None:
        try:
            for ch in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=300, stream=True
            ):
                out["chunks"] += 1
                if ch.choices and ch.choices[0].finish_reason:
                    out["finish"] = ch.choices[0].finish_reason
        except openai.APIError as e:
            out["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while out["chunks"] < 5:
        assert time.monotonic() < deadline and t.is_alive(), out
        time.sleep(0.005)
    serving = [k for k, u in enumerate(fleet.replica_urls) if running(u)]
    assert len(serving) == 1
    fleet.kill_replica(serving[0])
    t.join(timeout=60)
    assert not t.is_alive()
    assert out["error"] is not None and out["finish"] is None, out
    # the gateway serves the same request whole on the survivor
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=300)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 83
