"""Server-wide options beyond the engine's (auth, field strictness, thinking defaults, logging), and the key check."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from tandem.server.errors import APIError

REASONING_FORMATS = ("separate", "content")


@dataclass
class ServerOptions:
    """What `tandem serve` flags set for every request.

    Attributes:
        api_key: every /v1 route needs this key (`Authorization: Bearer KEY` or `x-api-key: KEY`); None: open.
        strict_fields: unknown request fields answer 400 (else they are ignored with a warning).
        reasoning_budget: the default thinking budget in tokens (None: unbounded).
        default_template_kwargs: chat template variables every request starts from (e.g. enable_thinking).
        reasoning_format: "separate" (reasoning in `reasoning_content` / thinking blocks) or "content" (kept in
            the content between `<think>` and `</think>`).
        log_prompts: the per-request log line carries the prompt text.
        max_stored_responses: how many /v1/responses results `previous_response_id` can name.
        max_stored_response_bytes: the most bytes the stored /v1/responses results take together.
    """

    api_key: str | None = None
    strict_fields: bool = False
    reasoning_budget: int | None = None
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_format: str = "separate"
    log_prompts: bool = False
    max_stored_responses: int = 256
    max_stored_response_bytes: int = 64 << 20


def request_key(request: Request) -> str | None:
    """The key a request presents: `x-api-key`, else the `Authorization: Bearer` token, else None."""
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def check_key(request: Request, api_key: str | None) -> None:
    """Raises APIError 401 when `api_key` is set and the request does not present it (constant-time compare)."""
    if api_key is None:
        return
    given = request_key(request)
    if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
        raise APIError(401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
                       code="invalid_api_key")
