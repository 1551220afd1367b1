"""Stopping the server: requests in flight get the drain time, then are aborted; a streaming
client still gets its last chunk (finish_reason "abort") and [DONE]; the engine is shut down."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from serve_helpers import MODEL, RawStream, make_engine

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
    for raw, reason in ((long, "abort"), (short, "length")):
        events = raw.events()
        assert events[-1] == b"[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == reason
    with pytest.raises(RuntimeError):
        eng.submit([5], 1)  # the lifespan shut the engine down
    assert eng.idle_invariant()
