"""Clients that vanish: mid-stream at random points, while queued before their first token, and
during a non-streaming request. Each aborts its request in the engine at once (far before its
max_tokens); afterwards the engine is idle and the server still answers correctly."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from serve_helpers import MODEL, RawStream, Served, make_engine, post_json, serve

from tokencache_routing import RequestHandle

LONG = 1500  # tokens a request would generate if nobody stopped it (seconds of decoding)
CUT = 400  # an aborted request must end far before LONG


@pytest.fixture()
def served(tiny: Any, request: Any) -> Iterator[Served]:
    max_running = getattr(request, "param", 16)
    # no eos: every request would decode LONG tokens unless aborted
    with serve(tiny, max_running=max_running, num_slots=40_000, eos_token_id=None) as s:
        yield s


def body(j: int, stream: bool = True) -> tuple[str, dict[str, Any]]:
    prompt = [5 + j % 50, 7, 9 + j % 7, 11]
    if j % 2:
        msgs = [{"role": "user", "content": f"t{j % 80} t3 t4"}]
        return "/v1/chat/completions", {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": LONG,
            "temperature": 0,
            "stream": stream,
        }
    return "/v1/completions", {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": LONG,
        "temperature": 0,
        "stream": stream,
    }


def open_stream(served: Served, j: int, stream: bool = True) -> tuple[RawStream, RequestHandle]:
    """Sends request j and returns it with its engine handle (waits for the submit)."""
    n = len(served.handles)
    path, b = body(j, stream)
    raw = RawStream(served.server.host, served.server.port, path, b)
    deadline = time.monotonic() + 30
    while len(served.handles) == n:
        assert time.monotonic() < deadline, "request never reached the engine"
        time.sleep(0.005)
    return raw, served.handles[n]


def wait_done(handles: list[RequestHandle], timeout: float) -> float:
    t0 = time.monotonic()
    for h in handles:
        assert h.wait(max(0.0, timeout - (time.monotonic() - t0))), f"{h} still running"
    return time.monotonic() - t0


def check_still_serving(served: Served, tiny: Any) -> None:
    status, r = post_json(
        served.url,
        "/v1/completions",
        {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0},
    )
    assert status == 200
    assert (
        r["choices"][0]["tokencache"]["token_ids"]
        == make_engine(tiny, eos_token_id=None).generate([[5, 6, 7]], 6).tokens[0]
    )
    served.wait_idle()


def test_streams_closed_at_random_points(served: Served, tiny: Any) -> None:
    rng = random.Random(13)
    streams = [open_stream(served, j) for j in range(12)]
    for raw, _ in streams:  # every stream is decoding
        assert raw.read_events(1) >= 1
    closed = []
    for raw, h in rng.sample(streams, len(streams)):
        raw.read_events(rng.randint(1, 8))
        raw.close()
        closed.append(h)
        time.sleep(rng.random() * 0.05)
    waited = wait_done(closed, timeout=20)
    for h in closed:
        assert h.finished_reason == "abort", h
        assert len(h.tokens) < CUT, f"{h} ran on after its client left"
    served.wait_idle()
    assert served.client().models.list().data[0].id == MODEL  # the server answers
    m = served.engine.metrics()
    assert m["requests_aborted"] >= len(closed)
    check_still_serving(served, tiny)
    print(f"12 streams closed; all aborted {waited:.2f} s after the last close")


@pytest.mark.parametrize("served", [2], indirect=True)
def test_queued_requests_abort_before_first_token(served: Served, tiny: Any) -> None:
    admitted = served.engine.sched_config.max_admitted  # max_running=2 decoding (+ parked)
    holders = [open_stream(served, j) for j in range(admitted)]  # these run
    for raw, _ in holders:
        assert raw.read_events(1) >= 1
    queued = [open_stream(served, j) for j in range(admitted, admitted + 4)]
    deadline = time.monotonic() + 10
    while served.engine.metrics()["requests_waiting"] < len(queued):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for raw, _ in queued:
        raw.close()
    wait_done([h for _, h in queued], timeout=10)
    for _, h in queued:
        assert h.finished_reason == "abort" and h.tokens == []
    assert not any(h.done() for _, h in holders)  # the others are unaffected
    for raw, _ in holders:
        raw.close()
    wait_done([h for _, h in holders], timeout=10)
    assert all(h.finished_reason == "abort" and len(h.tokens) < CUT for _, h in holders)
    check_still_serving(served, tiny)


def test_non_streaming_client_leaves(served: Served, tiny: Any) -> None:
    raws = [open_stream(served, j, stream=False) for j in range(4)]
    deadline = time.monotonic() + 20
    while not all(h.tokens for _, h in raws):  # every request is decoding
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for raw, _ in raws:
        raw.close()
    wait_done([h for _, h in raws], timeout=20)
    assert all(h.finished_reason == "abort" and len(h.tokens) < CUT for _, h in raws)
    check_still_serving(served, tiny)


def test_disconnects_are_counted(served: Served) -> None:
    raw, h = open_stream(served, 0)
    raw.read_events(2)
    raw.close()
    wait_done([h], timeout=10)
    served.wait_idle()
    import urllib.request

    def disconnects() -> float:
        with urllib.request.urlopen(served.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        prefix = "tokencache_client_disconnects_total"
        return float(next(x for x in text.splitlines() if x.startswith(prefix)).split()[-1])

    # The handler records the request after the engine let it go: under load, a moment later.
    deadline = time.monotonic() + 10
    while disconnects() < 1.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert disconnects() == 1.0
