"""Stopping the server: requests in flight get the drain time, then are aborted; a streaming
client gets an error event (503, as OpenAI's servers end a stream they cannot finish; "abort"
is no OpenAI finish_reason) and [DONE], a non-streaming one a 503; the engine is shut down."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from serve_helpers import MODEL, RawStream, make_engine, post_json

from tokencache_serve import ServerConfig, create_app
from tokencache_serve.runner import BackgroundServer


def test_shutdown_drains_then_aborts(tiny: Any) -> None:
    eng = make_engine(tiny, eos_token_id=None, num_slots=4096)
    app = create_app(eng, tiny[2], ServerConfig(model_name=MODEL))
    srv = BackgroundServer(app, drain_s=0.5).start()
    short = RawStream(
        srv.host,
        srv.port,
        "/v1/completions",
        {"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "temperature": 0, "stream": True},
    )
    long = RawStream(
        srv.host,
        srv.port,
        "/v1/completions",
        {"model": MODEL, "prompt": [5, 6], "max_tokens": 1500, "temperature": 0, "stream": True},
    )
    assert long.read_events(2) >= 2
    t0 = time.monotonic()
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    long.read_events(10_000)  # to the end of the stream
    short.read_events(10_000)
    stopper.join(30)
    assert not stopper.is_alive() and time.monotonic() - t0 < 10
    events = short.events()
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    events = long.events()
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])["error"]
    assert (err["type"], err["code"]) == ("server_error", "server_shutting_down")
    # every chunk before it is an ordinary one, with OpenAI's finish_reason values only
    reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in events[1:-2]]
    assert len(reasons) >= 1 and set(reasons) == {None}
    with pytest.raises(RuntimeError):
        eng.submit([5], 1)  # the lifespan shut the engine down
    assert eng.idle_invariant()


def test_shutdown_answers_a_waiting_non_streaming_request_with_503(tiny: Any) -> None:
    eng = make_engine(tiny, eos_token_id=None, num_slots=4096)
    app = create_app(eng, tiny[2], ServerConfig(model_name=MODEL))
    srv = BackgroundServer(app, drain_s=0.5).start()
    got: list[tuple[int, Any]] = []
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1500, "temperature": 0}
    t = threading.Thread(target=lambda: got.append(post_json(srv.url, "/v1/completions", body)))
    t.start()
    deadline = time.monotonic() + 30
    while eng.metrics()["tokens_generated"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.stop()
    t.join(30)
    ((status, err),) = got
    assert status == 503, err  # not a 200 with truncated text
    assert err["error"]["code"] == "server_shutting_down"
