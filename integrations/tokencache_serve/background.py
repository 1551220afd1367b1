"""An app under uvicorn on a free loopback port, in a background thread (tests, benchmark)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from starlette.types import ASGIApp


class BackgroundServer:
    """with BackgroundServer(app) as srv: ... srv.url ...; binds 127.0.0.1 only."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # port 0: the OS picks a free one
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
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
