"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Two families: `tandem_*` (this server's own) and vLLM's names (`vllm:e2e_request_latency_seconds`, ...; the
names and labels of vLLM's `/metrics`, with a `model_name` label) so dashboards written for vLLM read them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]


_LATENCY = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Requests, queue depth, TTFT, tokens/s, tokens per round, token counts; vLLM's request metrics.

    Args:
        model_name: the `model_name` label of the vLLM-named metrics.
    """

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.queue_depth = Gauge("tandem_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("tandem_running", "requests the engine is generating for (slots in use)", registry=r)
        self.slots = Gauge("tandem_slots", "sequence slots (--parallel): requests generated at once", registry=r)
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

        self.model_name = model_name
        m = ["model_name"]
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "arrival to last token", m, buckets=_LATENCY,
                             registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "arrival to first token", m,
                                   buckets=_LATENCY, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "seconds between committed tokens", m,
                             buckets=(.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56), registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "seconds waiting for the engine", m,
                                    buckets=_LATENCY, registry=r)
        self.success = Counter("vllm:request_success", "finished requests by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.vllm_prompt = Counter("vllm:prompt_tokens", "prompt tokens", m, registry=r)
        self.vllm_generation = Counter("vllm:generation_tokens", "generated tokens", m, registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "draft tokens accepted", m, registry=r)
        self.spec_draft = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens verified", m, registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "speculative rounds", m, registry=r)
        for metric in (self.e2e, self.vllm_ttft, self.itl, self.queue_time, self.vllm_prompt, self.vllm_generation,
                       self.spec_accepted, self.spec_draft, self.spec_drafts):
            metric.labels(model_name)  # shown (at 0) before the first request

    def observe_round(self, num_tokens: int, num_nodes: int | None, seconds_since_last: float | None) -> None:
        """One committed chunk: generated tokens, speculation counts (num_nodes > 1) and inter-token latency."""
        name = self.model_name
        self.vllm_generation.labels(name).inc(num_tokens)
        if num_nodes is not None and num_nodes > 1:
            self.spec_drafts.labels(name).inc()
            self.spec_draft.labels(name).inc(num_nodes - 1)
            self.spec_accepted.labels(name).inc(max(0, num_tokens - 1))
        if seconds_since_last is not None and num_tokens > 0:
            for _ in range(num_tokens):
                self.itl.labels(name).observe(seconds_since_last / num_tokens)

    def observe_request(self, e2e_s: float, ttft_s: float | None, queue_s: float, prompt_tokens: int,
                        finish_reason: str | None) -> None:
        """One finished request (vLLM's per-request metrics)."""
        name = self.model_name
        self.e2e.labels(name).observe(e2e_s)
        if ttft_s is not None:
            self.vllm_ttft.labels(name).observe(ttft_s)
        self.queue_time.labels(name).observe(queue_s)
        self.vllm_prompt.labels(name).inc(prompt_tokens)
        self.success.labels(name, finish_reason or "abort").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))
