"""Running the app under uvicorn: a shutdown that drains, then aborts what is left; and a
server on a free loopback port in a background thread (tests, benchmark)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn
from starlette.types import ASGIApp

DRAIN_S = 5.0


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


def make_config(app: ASGIApp, drain_s: float = DRAIN_S, **kw: Any) -> uvicorn.Config:
    """uvicorn.Config whose graceful-shutdown timeout leaves room for the drain and the aborts."""
    return uvicorn.Config(app, timeout_graceful_shutdown=int(drain_s) + 5, **kw)


class BackgroundServer:
    """with BackgroundServer(app) as srv: ... srv.url ...; binds 127.0.0.1 only."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        drain_s: float = DRAIN_S,
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # port 0: the OS picks a free one
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = make_config(app, drain_s, log_level=log_level, access_log=False)
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
