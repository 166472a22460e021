"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]


class Metrics:
    """Requests, queue depth, TTFT, tokens/s, tokens per round, token counts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.queue_depth = Gauge("tandem_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("tandem_running", "requests the engine is generating for", registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tokens_per_s = Histogram("tandem_decode_tokens_per_second", "decode speed of a finished sequence",
                                      buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000), registry=r)
        self.tokens_per_round = Histogram("tandem_tokens_per_round", "tokens committed per engine round",
                                          buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("tandem_generated_tokens", "tokens generated", registry=r)
        self.started = Counter("tandem_engine_started_requests", "requests the engine started", registry=r)
        self.rejected = Counter("tandem_rejected_requests", "requests refused by the queue", ["reason"], registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))
