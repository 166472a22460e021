"""The prefix cache's HTTP surface: ``GET /v1/cache`` (entries, bytes, budgets, hit figures per tier),
``DELETE /v1/cache`` (drop every entry), and its Prometheus series (a collector read at every scrape)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from tandem.engine import Engine


def cache_body(engine: Engine) -> dict[str, Any]:
    """The JSON of ``GET /v1/cache``: {"enabled": false} without a cache, else the cache's ``info()``."""
    if engine.cache is None:
        return {"object": "cache", "enabled": False}
    return {"object": "cache", "enabled": True, **engine.cache.info()}


async def cache_route(request: Request, engine: Engine) -> Response:
    """GET: the cache's figures. DELETE: drop every entry of every tier (counters are kept); 200
    {"deleted": entries} (a running request keeps its own state and finds nothing afterwards)."""
    if request.method == "DELETE":
        body: dict[str, Any] = {"object": "cache", "deleted": engine.cache.clear() if engine.cache else 0}
    else:
        body = cache_body(engine)
    return Response(orjson.dumps(body), media_type="application/json")


class CacheCollector:
    """Prometheus series of an engine's prefix cache: hits, misses, reused and prefilled tokens, snapshots,
    refusals, evictions per tier (counters), entries and bytes per tier (gauges)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        cache = self.engine.cache
        if cache is None:
            return
        info = cache.info()
        for name, key, doc in (("hits", "hits", "requests that restored a cached prefix"),
                               ("misses", "misses", "requests that found no cached prefix"),
                               ("reused_tokens", "reused_tokens", "prompt tokens restored instead of prefilled"),
                               ("prefilled_tokens", "prefilled_tokens", "prompt tokens prefilled"),
                               ("snapshots", "snapshots", "snapshots taken"),
                               ("refused", "refused", "snapshots refused for lack of room")):
            yield CounterMetricFamily(f"tandem_cache_{name}", doc, value=info[key])
        evictions = CounterMetricFamily("tandem_cache_evictions", "blocks evicted from a tier", labels=["tier"])
        entries = GaugeMetricFamily("tandem_cache_entries", "blocks held by a tier", labels=["tier"])
        nbytes = GaugeMetricFamily("tandem_cache_bytes", "bytes held by a tier", labels=["tier"])
        for tier, t in info["tiers"].items():
            evictions.add_metric([tier], t["evictions"])
            entries.add_metric([tier], t["entries"])
            nbytes.add_metric([tier], t["bytes"])
        yield evictions
        yield entries
        yield nbytes


class SlotCollector:
    """Prometheus series of an engine's joint rounds (tandem/slots.py): passes run and the slot rounds they carried
    (counters; their ratio is the mean number of slots a pass served)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        rounds = self.engine.rounds
        if rounds is None:
            return
        yield CounterMetricFamily("tandem_joint_passes", "joint forward passes run for the slots",
                                  value=rounds.passes)
        yield CounterMetricFamily("tandem_joint_slot_rounds", "slot rounds (decode steps, verify trees) the joint "
                                  "passes carried", value=rounds.items)
