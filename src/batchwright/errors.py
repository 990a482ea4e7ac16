"""One error hierarchy, rendered in OpenAI's envelope {"error": {message, type, param, code}}."""

from __future__ import annotations

import math
from typing import Any


class APIError(Exception):
    status_code = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        # Seconds after which the same request may pass (a 429, a 503 of a busy or
        # briefly unavailable service): sent as Retry-After.
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {
            "retry-after": str(max(1, math.ceil(self.retry_after))),
            "retry-after-ms": str(max(1, math.ceil(self.retry_after * 1000))),
        }

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": _utf8(self.message),
                "type": self.type,
                "param": None if self.param is None else _utf8(self.param),
                "code": self.code,
            }
        }


def _utf8(text: str) -> str:
    """`text` as valid UTF-8: a lone surrogate the client sent (valid JSON, "\\ud800") and
    quoted back in a message is written as its escape instead of failing the response."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


class InvalidRequest(APIError):
    status_code = 400
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    status_code = 413
    code = "file_too_large"


class Unauthorized(APIError):
    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(APIError):
    status_code = 404
    type = "invalid_request_error"
    code = "not_found"


class Conflict(APIError):
    status_code = 409
    type = "invalid_request_error"


class RateLimited(APIError):
    """429 as OpenAI sends it: `type` names the limit ("requests" or "tokens")."""

    status_code = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.type = limit


class Unavailable(APIError):
    status_code = 503
    type = "server_error"
    code = "service_unavailable"
