"""OpenAI's JSON error shape and the exception that carries it to the HTTP layer."""

from __future__ import annotations

import reprlib
from typing import Any

import orjson

MAX_QUOTE_CHARS = 80  # the most of a bad value an error message quotes
MAX_MESSAGE_CHARS = 1000  # the longest error message (anything longer is cut)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, MAX_QUOTE_CHARS, MAX_QUOTE_CHARS

_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
          413: "invalid_request_error", 415: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    """A request failed with an HTTP status and an OpenAI-style error object.

    Args:
        status: HTTP status (400, 403, 404, 408, 413, 415, 429, 503, 500).
        message: a sentence for the user.
        param: the request field at fault (e.g. "max_tokens", "messages[0].content"), or None.
        code: a machine-readable code (e.g. "context_length_exceeded"), or None.
        retry_after_s: sets the Retry-After header (503 / 429).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "…"
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param if param is None or len(param) <= MAX_QUOTE_CHARS else param[:MAX_QUOTE_CHARS] + "…"
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """{"error": {"message", "type", "param", "code"}} as OpenAI sends it."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def to_bytes(self) -> bytes:
        """The body as JSON bytes (orjson)."""
        return orjson.dumps(self.body())

    def headers(self) -> dict[str, str]:
        """Extra response headers (Retry-After when set)."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def internal_error(exc: BaseException, log: Any = None) -> APIError:
    """A 500 for an unexpected exception: the client reads only that it failed and where to look; the exception's
    type and text (Python or native internals) go to `log` (a logging.Logger, with the trace), never to the client."""
    if log is not None:
        log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return APIError(500, "internal error; the server log has the details", code="internal_error")


def invalid(param: str, message: str) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=param, code="invalid_value")


def quote(value: Any) -> str:
    """A short repr of a bad value for an error message: a string's first MAX_QUOTE_CHARS characters (then "…"),
    any other value's repr cut there, nesting
    shown three levels deep, so a huge or deeply nested value is never echoed whole (and never recursed into)."""
    if isinstance(value, str):
        return repr(value[:MAX_QUOTE_CHARS]) + ("…" if len(value) > MAX_QUOTE_CHARS else "")
    text = _REPR.repr(value)
    return text if len(text) <= MAX_QUOTE_CHARS else text[:MAX_QUOTE_CHARS] + "…"
