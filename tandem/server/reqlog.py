"""One log line per request: route, status, token counts, time to first token, decode speed, finish reason.

The prompt text is logged only with `--log-prompts` (it may hold private data). The record is also where a finished
request's facts gather for the live activity and the usage ledger: `done()` runs its `sinks` after the line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field

log = logging.getLogger("tandem.server.requests")


@dataclass
class RequestRecord:
    """What a route learns about its request; `done()` writes the line once (at the end of a stream too)."""

    route: str
    arrived: float = field(default_factory=time.perf_counter)
    status: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    finish_reason: str | None = None
    prompt: str | None = None
    ignored: list[str] = field(default_factory=list)
    body_bytes: int = 0
    tenant: str | None = None
    slot: int | None = None  # the engine slot that served it
    small: bool = False  # counted among the small requests in flight (ServerState.small_started)
    written: bool = False
    wall_arrived: float = field(default_factory=time.time)  # Unix seconds, for the ledger
    model: str | None = None
    agent: str | None = None  # the User-Agent's first product (e.g. "OpenAI/Python"), for the ledger's client view
    queue_s: float | None = None  # waiting for a slot
    num_rounds: int = 0  # the first choice's rounds, their tokens, draft tokens verified and accepted
    round_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    cache_tier: str = ""  # the slowest prefix-cache tier its prompt was restored from
    reply: str | None = None  # the first choice's text, kept only with --log-prompts
    sinks: list[Callable[["RequestRecord"], None]] = field(default_factory=list)  # run by done(), in order

    def done(self) -> None:
        """Write the line (at info level) unless it was written already."""
        if self.written:
            return
        self.written = True
        parts = [f"{self.route} {self.status}"]
        if self.prompt_tokens is not None:
            parts.append(f"prompt={self.prompt_tokens} cached={self.cached_tokens or 0} "
                         f"completion={self.completion_tokens}")
        if self.ttft_s is not None:
            parts.append(f"ttft={self.ttft_s * 1e3:.0f}ms")
        if self.tokens_per_s is not None:
            parts.append(f"tok/s={self.tokens_per_s:.1f}")
        if self.finish_reason is not None:
            parts.append(f"finish={self.finish_reason}")
        parts.append(f"time={time.perf_counter() - self.arrived:.3f}s")
        if self.slot is not None:
            parts.append(f"slot={self.slot}")
        if self.tenant is not None:
            parts.append(f"tenant={self.tenant}")
        if self.ignored:
            parts.append(f"ignored={','.join(self.ignored)}")
        if self.prompt is not None:
            parts.append(f"prompt_text={self.prompt!r}")
        log.info(" ".join(parts))
        for sink in self.sinks:
            try:
                sink(self)
            except Exception:  # the activity's or the ledger's bookkeeping never fails a request
                log.exception("%s: a request's bookkeeping failed", self.route)


async def logged_stream(body: AsyncIterable[str | bytes | memoryview], record: RequestRecord
                        ) -> AsyncIterator[str | bytes | memoryview]:
    """`body`, then the record's line once the stream has ended (or was cut off)."""
    try:
        async for part in body:
            yield part
    finally:
        record.done()
