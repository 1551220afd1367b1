"""Running the app under uvicorn: a shutdown that drains, then aborts what is left; slow or
too many connections refused at the HTTP layer; and a server on a free loopback port in a
background thread (tests, benchmark)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import TracebackType
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

DRAIN_S = 5.0
HEADER_TIMEOUT_S = 10.0  # a request head (request line and headers) must arrive within this
MAX_CONNECTIONS = 512  # open connections; one more is answered 503 and closed


def _error_body(message: str, type: str, code: str) -> bytes:
    err = {"message": message, "type": type, "param": None, "code": code}
    return json.dumps({"error": err}).encode()


async def _overloaded(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a connection over the cap, in OpenAI's error format."""
    body = _error_body(
        "The server has too many open connections; retry later.",
        "server_error",
        "too_many_connections",
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


LINGER_S = 5.0  # how long a refused body is still read (and dropped) after its answer


class _LingeringTransport:
    """A connection's transport whose close(), while the client is still sending the body of
    a request already answered (a 413), first half-closes and drops what still comes for
    LINGER_S (nginx's lingering close): a client that writes its whole body before reading
    (urllib, which also asks for Connection: close) then reads the 413 instead of a reset."""

    def __init__(self, transport: asyncio.Transport, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        t = self._transport
        if self.lingering or t.is_closing():
            return  # the linger timer closes it (or it is closed already)
        if self._protocol.conn.their_state is h11.SEND_BODY and t.can_write_eof():
            self.lingering = True
            t.write_eof()  # after what is buffered: the answer goes out whole
            t.resume_reading()
            self._protocol.loop.call_later(LINGER_S, t.close)
            return
        t.close()


def guarded_protocol(header_timeout_s: float | None, max_connections: int | None) -> type:
    """uvicorn's h11 protocol with a request-head timeout and a connection cap.

    A connection whose request head is not complete header_timeout_s after it opened (or after
    its previous response) is closed: slow or silent clients cannot hold connections open, nor
    keep sending a body that was refused.
    uvicorn's own limit_concurrency counts tasks too and answers in plain text; this one
    counts open connections and answers 503 in OpenAI's format.
    """

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _lingering: _LingeringTransport

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._lingering = _LingeringTransport(transport, self)
            super().connection_made(self._lingering)  # type: ignore[arg-type]
            if max_connections is not None and len(self.connections) > max_connections:
                self.app = _overloaded
            self._arm_header_timer()

        def _answered(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._lingering.lingering:
                return  # the rest of a refused body: dropped
            super().data_received(data)
            if self._header_timer is not None and not self._answered():
                self._cancel_header_timer()  # a new request's head is in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's head has the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # Not HTTP at all (a bad request line or header): uvicorn's 400, in OpenAI's format.
            body = _error_body(
                "Invalid HTTP request received.", "invalid_request_error", "invalid_http"
            )
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event) or b"")
            self.transport.close()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            if header_timeout_s is not None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_late(self) -> None:
            # No new request began in time: the client is idle, slow, or still sending the
            # body of a request already answered (a 413: uvicorn reads and drops the rest, so
            # that the client, still writing, can read the answer; this bounds how long).
            self._header_timer = None
            waiting = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
            if self._answered() and waiting and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


class DrainingServer(uvicorn.Server):
    """At shutdown, requests in flight get `drain_s` seconds to finish; then they are aborted in
    the engine, so each client still gets a proper end (finish_reason "abort", `[DONE]`)
    instead of a connection cut by uvicorn's task cancellation."""

    def __init__(self, config: uvicorn.Config, drain_s: float = DRAIN_S) -> None:
        super().__init__(config)
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        server = getattr(getattr(self.config.app, "state", None), "server", None)
        abort_all = getattr(server, "abort_all", None)
        timer = None
        if abort_all is not None:
            timer = asyncio.get_running_loop().call_later(self.drain_s, abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def make_config(
    app: ASGIApp,
    drain_s: float = DRAIN_S,
    header_timeout_s: float | None = HEADER_TIMEOUT_S,
    max_connections: int | None = MAX_CONNECTIONS,
    **kw: Any,
) -> uvicorn.Config:
    """uvicorn.Config whose graceful-shutdown timeout leaves room for the drain and the aborts,
    over the guarded h11 protocol (None: no header timeout / no connection cap)."""
    return uvicorn.Config(
        app,
        timeout_graceful_shutdown=int(drain_s) + 5,
        http=guarded_protocol(header_timeout_s, max_connections),
        **kw,
    )


class BackgroundServer:
    """with BackgroundServer(app) as srv: ... srv.url ...; binds 127.0.0.1 only."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        drain_s: float = DRAIN_S,
        header_timeout_s: float | None = HEADER_TIMEOUT_S,
        max_connections: int | None = MAX_CONNECTIONS,
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # port 0: the OS picks a free one
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = make_config(
            app,
            drain_s,
            header_timeout_s,
            max_connections,
            log_level=log_level,
            access_log=False,
        )
        self.server = DrainingServer(config, drain_s)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not started after {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        if self._thread.is_alive():
            raise TimeoutError(f"server thread still running {timeout} s after stop")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
