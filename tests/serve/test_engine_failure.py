"""A request the engine fails (its router raised) is answered with a 500 in OpenAI's format, or
an error event closing its stream, without the exception's text (the log has it); the server
and the engine keep serving."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from serve_helpers import MODEL, RawStream, Served, post_json

from tokencache_routing import EngineConfig, EntropyRouter, RoutedEngine, Router, RouterFeatures
from tokencache_routing.core.scheduler_config import SchedulerConfig
from tokencache_serve import ServerConfig, create_app
from tokencache_serve.runner import BackgroundServer
from tokencache_serve.tiny import TINY_ENTROPY_THRESHOLD


class FailingRouter(Router):
    """Entropy routing that raises on its next call once `armed` is set."""

    def __init__(self) -> None:
        self.inner = EntropyRouter(TINY_ENTROPY_THRESHOLD)
        self.armed = threading.Event()

    def route(self, f: RouterFeatures) -> torch.Tensor:
        if self.armed.is_set():
            self.armed.clear()
            raise RuntimeError("router exploded")
        return self.inner.route(f)


@pytest.fixture(scope="module")
def failing(tiny: Any) -> Iterator[tuple[Served, FailingRouter]]:
    small, large, tok = tiny
    router = FailingRouter()
    eng = RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(
            num_slots=4096,
            scheduler=SchedulerConfig(max_running=4),
            tokenizer=tok,
            eos_token_id=None,
        ),
    )
    app = create_app(eng, tok, ServerConfig(model_name=MODEL))
    with BackgroundServer(app) as srv:
        yield Served(eng, srv, tok), router


def body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }


def test_failed_request_is_a_500_and_serving_goes_on(failing: tuple[Served, FailingRouter]) -> None:
    served, router = failing
    ok_status, ok = post_json(served.url, "/v1/completions", body(False))
    assert ok_status == 200
    router.armed.set()
    status, err = post_json(served.url, "/v1/completions", body(False))
    assert status == 500
    assert err["error"]["type"] == "server_error"
    assert err["error"]["message"] == "The engine failed this request."
    assert set(err["error"]) == {"message", "type", "param", "code"}
    again = post_json(served.url, "/v1/completions", body(False))
    assert again == (200, {**again[1], "choices": again[1]["choices"]})
    assert (
        again[1]["choices"][0]["tokencache"]["token_ids"]
        == ok["choices"][0]["tokencache"]["token_ids"]
    )
    assert served.engine.metrics()["requests_failed"] == 1
    assert served.engine.idle_invariant()


def test_failed_stream_ends_with_an_error_event(failing: tuple[Served, FailingRouter]) -> None:
    served, router = failing
    router.armed.set()
    raw = RawStream(served.server.host, served.server.port, "/v1/completions", body(True))
    raw.read_events(10_000)
    events = raw.events()
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])
    assert err["error"]["type"] == "server_error" and "exploded" not in err["error"]["message"]
    status, r = post_json(served.url, "/v1/completions", body(False))
    assert status == 200 and len(r["choices"][0]["tokencache"]["token_ids"]) == 8
