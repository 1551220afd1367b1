"""A request's body read off the connection: JSON only, at most a size limit, complete within a
deadline. Each refusal is an APIError: 415 (not JSON), 413 (too large), 408 (too slow), 400
(the client left mid-body)."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from .errors import APIError
from .protocol import shown


async def read_json_body(request: Request, limit: int, timeout_s: float) -> bytes:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(
            415,
            "The request body must be JSON, sent with 'Content-Type: application/json'"
            f"{f' (got {shown(media)!r})' if media else ''}.",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)  # refused before a byte of it is read
    try:
        return await asyncio.wait_for(_body_within(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout_s:g} s.",
            code="request_timeout",
            headers={"connection": "close"},
        ) from None
    except ClientDisconnect:
        raise APIError(400, "The client disconnected while sending the body.") from None


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server accepts ({limit} bytes, --max-body-bytes).",
        code="request_too_large",
    )  # the rest of the body is dropped as it comes (runner.guarded_protocol bounds how long)


async def _body_within(request: Request, limit: int) -> bytes:
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:  # a body without (or beyond) its Content-Length
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)
