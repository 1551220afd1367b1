"""API-key authentication for the /v1 routes (OpenAI's `Authorization: Bearer KEY`), and the
Host check that keeps a DNS-rebinding web page off a loopback server.

Pure ASGI middlewares, so a refused request is answered before its body is read or anything
else runs. /health and /metrics need no key (probes and scrapers carry none).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _error(message: str, code: str | None) -> bytes:
    err = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": err}).encode()


async def _refuse(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def host_name(value: bytes) -> str:
    """The host of a Host header, without its port ("[::1]:8000" -> "::1")."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].partition("]")[0]
    return text.rpartition(":")[0] if text.count(":") == 1 else text


class TrustedHostMiddleware:
    """Refuses (400) a request whose Host is not one of `hosts`. A web page that rebinds its
    own domain's DNS to 127.0.0.1 talks to a loopback server as its own origin (no CORS in the
    way, any Content-Type); its requests still name its domain in Host, and are refused."""

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...]) -> None:
        self.app = app
        self._hosts = frozenset(h.lower().strip("[]") for h in hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = next((v for k, v in scope["headers"] if k == b"host"), b"")
        if host_name(host) in self._hosts:
            await self.app(scope, receive, send)
            return
        body = _error(
            "The Host header names a host this server does not serve (--allowed-hosts).",
            "invalid_host",
        )
        await _refuse(send, 400, body, [])


class APIKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        on_refusal: Callable[[str, int], None] | None = None,
    ) -> None:
        self.app = app
        self._key = api_key.encode()
        self._on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (
            path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
        ):
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                break
        if given is not None and hmac.compare_digest(given, self._key):
            await self.app(scope, receive, send)
            return
        if given is None:
            body = _error(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                None,
            )
        else:  # never echo what was sent
            body = _error("Incorrect API key provided.", "invalid_api_key")
        if self._on_refusal is not None:
            self._on_refusal(path, 401)
        await _refuse(send, 401, body, [(b"www-authenticate", b"Bearer")])
