"""API-key authentication for the /v1 routes (OpenAI's `Authorization: Bearer KEY`).

A pure ASGI middleware, so a refused request is answered before its body is read or anything
else runs. /health and /metrics stay open (probes and scrapers carry no key).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"


def _error(message: str, code: str | None) -> bytes:
    err = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": err}).encode()


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
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
