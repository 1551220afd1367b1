"""OpenAI's JSON error format: {"error": {"message", "type", "param", "code"}} with a status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses; rendered as OpenAI's error object with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers  # e.g. connection: close when the body was not read
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
