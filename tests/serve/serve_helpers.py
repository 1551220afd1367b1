"""Shared helpers of the serving tests (a unique module name: tests/*/conftest.py collide)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tokencache_routing import EngineConfig, EntropyRouter, RequestHandle, RoutedEngine
from tokencache_routing.core.scheduler_config import SchedulerConfig
from tokencache_serve import ServerConfig, create_app
from tokencache_serve.runner import BackgroundServer
from tokencache_serve.tiny import TINY_ENTROPY_THRESHOLD

MODEL = "tiny-routed"


def make_engine(tiny: Any, max_running: int = 8, num_slots: int = 8192, **kw: Any) -> RoutedEngine:
    small, large, tok = tiny
    kw.setdefault("eos_token_id", tok.eos_token_id)
    return RoutedEngine(
        small,
        large,
        EntropyRouter(TINY_ENTROPY_THRESHOLD),
        config=EngineConfig(
            num_slots=num_slots,
            scheduler=SchedulerConfig(max_running=max_running),
            tokenizer=tok,
            **kw,
        ),
    )


@dataclass
class Served:
    engine: RoutedEngine
    server: BackgroundServer
    tokenizer: Any
    handles: list[RequestHandle] = field(default_factory=list)  # every submit, in order

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw
        )

    def async_client(self, **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw
        )

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Every submitted request finished, nothing running or queued, KV back to free/cached."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.engine.metrics()
            done = all(h.done() for h in self.handles)
            quiet = done and m["requests_running"] == 0 and m["requests_waiting"] == 0
            pinned = m.get("small_kv_slots_pinned", 0) + m.get("large_kv_slots_pinned", 0)
            if quiet and pinned == 0 and self.engine.idle_invariant():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {m}")
            time.sleep(0.02)


@contextmanager
def serve(
    tiny: Any, server_config: dict[str, Any] | None = None, **engine_kw: Any
) -> Iterator[Served]:
    """A server on 127.0.0.1 (free port) over a fresh engine; records every submitted handle.
    server_config: ServerConfig fields beyond the model name and greedy default."""
    eng = make_engine(tiny, **engine_kw)
    served = Served(eng, None, tiny[2])  # type: ignore[arg-type]
    submit = eng.submit

    def recording_submit(*a: Any, **kw: Any) -> RequestHandle:
        h = submit(*a, **kw)
        served.handles.append(h)
        return h

    eng.submit = recording_submit  # type: ignore[method-assign]
    config = ServerConfig(model_name=MODEL, default_temperature=0.0, **(server_config or {}))
    app = create_app(eng, tiny[2], config)
    with BackgroundServer(app) as srv:
        served.server = srv
        yield served
    # the app's lifespan shut the engine down: every request ended, the driver joined
    assert all(h.done() for h in served.handles)


def post_raw(url: str, path: str, body: bytes, method: str = "POST") -> tuple[int, Any]:
    """(status, parsed JSON body) without raising on error statuses."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=body if method == "POST" else None, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_json(url: str, path: str, body: Any) -> tuple[int, Any]:
    return post_raw(url, path, json.dumps(body).encode())


class RawStream:
    """A streaming request on a bare socket, so a test can read k events and vanish."""

    def __init__(self, host: str, port: int, path: str, body: Any) -> None:
        data = json.dumps(body).encode()
        self.sock = socket.create_connection((host, port), timeout=60)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        self.sock.sendall(head.encode() + data)
        self.buf = b""

    def read_events(self, k: int) -> int:
        """Reads until k SSE events arrived (or the stream ended); returns how many came."""
        while self.buf.count(b"data: ") < k:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.buf += chunk
        return self.buf.count(b"data: ")

    def events(self) -> list[bytes]:
        """The SSE events received so far ('data: ...' payloads), chunked encoding removed."""
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        body = b""
        if b"transfer-encoding: chunked" in head.lower():
            while rest:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                if size == 0:
                    break
                body += rest[:size]
                rest = rest[size + 2 :]
        else:
            body = rest
        return [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e.strip()]

    def close(self) -> None:
        self.sock.close()
