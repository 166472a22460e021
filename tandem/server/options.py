"""Server-wide options beyond the engine's (auth, field strictness, thinking defaults, logging); the key check is
tandem/server/tenants.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONING_FORMATS = ("separate", "content")


@dataclass
class ServerOptions:
    """What `tandem serve` flags set for every request.

    Attributes:
        api_key: one key, the tenant "default" (kept for callers that set one key; `tenants` is the general form).
        tenants: tenant name -> key (tandem/server/tenants.py); every /v1 route needs one of the keys
            (`Authorization: Bearer KEY` or `x-api-key: KEY`); empty (and no api_key): open.
        metrics_auth: /metrics needs a key too (it is open by default, as /health).
        strict_fields: unknown request fields answer 400 (else they are ignored with a warning).
        reasoning_budget: the default thinking budget in tokens (None: unbounded).
        default_template_kwargs: chat template variables every request starts from (e.g. enable_thinking).
        reasoning_format: "separate" (reasoning in `reasoning_content` / thinking blocks) or "content" (kept in
            the content between `<think>` and `</think>`).
        log_prompts: the per-request log line carries the prompt text.
        max_stored_responses: how many /v1/responses results `previous_response_id` can name.
        max_stored_response_bytes: the most bytes the stored /v1/responses results take together.
        responses_events: "openai" or "open-responses": the names /v1/responses gives its reasoning events
            (responses_events.py: the one place the two specs differ).
        activity: keep the live activity (``GET /v1/activity``, the dashboard; tandem/server/activity.py).
        ledger: the usage ledger's SQLite file (tandem/server/ledger.py); None: no ledger.
        seed: the sampling seed of a request that names none (llama-server's ``--seed``; choice i of an n > 1
            request uses seed + i, as a request's own seed); None: a random seed per request.
    """

    api_key: str | None = None
    tenants: dict[str, str] = field(default_factory=dict)
    metrics_auth: bool = False
    strict_fields: bool = False
    reasoning_budget: int | None = None
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_format: str = "separate"
    log_prompts: bool = False
    max_stored_responses: int = 256
    max_stored_response_bytes: int = 64 << 20
    responses_events: str = "openai"
    activity: bool = True
    ledger: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.api_key and not self.tenants:
            self.tenants = {"default": self.api_key}
