"""What the engine is doing and what it did, over HTTP: ``GET /v1/activity`` (JSON), ``GET /v1/activity/stream``
(server-sent events of it), ``GET /v1/usage`` (the ledger, JSON or CSV), and the dashboard page that reads them
(``GET /dashboard``: static files shipped in tandem/server/dashboard/, no build step, nothing from another origin).

The ``/v1`` routes are keyed like every ``/v1`` route (app.py ``_route``); the page and its assets are open (they
hold no data: the page asks for the key when a ``/v1`` read answers 401 and keeps it in the tab's sessionStorage).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tandem.server.activity import engine_info
from tandem.server.errors import APIError, invalid
from tandem.server.ledger import parse_time, to_csv, to_json
from tandem.server.state import ServerState, json_response

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"
ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "logic.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}
# the page runs only its own files: no inline script, no other origin, no framing
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                          "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.2, 60.0
MAX_USAGE_ROWS = 100_000


def _off() -> Response:
    return json_response({"object": "activity", "enabled": False})


async def _snapshot(state: ServerState, history_after: float | None = None, recent: bool = True) -> dict[str, Any]:
    """The activity body: the engine-wide figures gathered in a thread (the cache's lock may be held by a
    restore), the live part on the event loop (which owns it)."""
    info = await asyncio.get_running_loop().run_in_executor(None, engine_info, state.engine)
    info["model"] = state.served_name
    return state.activity.snapshot(state.scheduler, info, history_after, recent)


async def activity_route(request: Request, state: ServerState) -> Response:
    """GET /v1/activity: the running and waiting requests, rates, history, cache, memory (activity.py)."""
    if not state.activity.enabled:
        return _off()
    return json_response(await _snapshot(state))


def _interval(request: Request) -> float:
    raw = request.query_params.get("interval", "1")
    try:
        value = float(raw)
    except ValueError:
        raise invalid("interval", "'interval' must be a number of seconds") from None
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise invalid("interval", f"'interval' must be between {MIN_INTERVAL_S:g} and {MAX_INTERVAL_S:g} seconds")
    return value


async def activity_stream_route(request: Request, state: ServerState) -> Response:
    """GET /v1/activity/stream?interval=S: an ``activity`` event every S seconds (default 1). The first event
    carries the whole history and the recent requests; each later one the seconds and finished requests since the
    one before. The stream ends when the server drains."""
    if not state.activity.enabled:
        return _off()
    interval = _interval(request)

    async def events() -> AsyncIterator[bytes]:
        after: float | None = None
        seen = state.activity.num_finished
        first = True
        while True:
            body = await _snapshot(state, after, recent=first)
            if not first:  # only the requests finished since the last event
                fresh = state.activity.num_finished - seen
                body["recent"] = list(state.activity.finished)[-fresh:] if fresh > 0 else []
            seen, first = state.activity.num_finished, False
            if body["history"]:
                after = body["history"][-1][0]
            yield b"event: activity\ndata: " + orjson.dumps(body) + b"\n\n"
            if state.scheduler.draining:
                return
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def usage_route(request: Request, state: ServerState) -> Response:
    """GET /v1/usage?since=&until=&group=&format=&limit=: the ledger's rows that ended in [since, until), grouped
    by ``group`` (comma-separated: day, hour, client, agent, model, route, status, finish_reason, cache_tier) or
    raw (at most ``limit``, default 1000); ``format=csv`` for CSV. 404 when the server keeps no ledger."""
    ledger = state.ledger
    if ledger is None:
        raise APIError(404, "this server keeps no usage ledger (tandem serve --ledger PATH)", code="ledger_off")
    q = request.query_params
    bounds: list[float | None] = []
    for param in ("since", "until"):
        try:
            bounds.append(parse_time(q.get(param), param))
        except ValueError as exc:
            raise invalid(param, str(exc)) from None
    since, until = bounds
    group = [g.strip() for g in q.get("group", "").split(",") if g.strip()]
    fmt = q.get("format", "json")
    if fmt not in ("json", "csv"):
        raise invalid("format", "'format' must be 'json' or 'csv'")
    try:
        limit = int(q.get("limit", "1000"))
    except ValueError:
        raise invalid("limit", "'limit' must be an integer") from None
    if not 1 <= limit <= MAX_USAGE_ROWS:
        raise invalid("limit", f"'limit' must be between 1 and {MAX_USAGE_ROWS}")

    def read() -> tuple[list[str], list[tuple[Any, ...]]]:
        ledger.flush(1.0)  # the rows of requests that just ended are in the answer
        return ledger.usage(since, until, group, limit)

    try:
        names, rows = await asyncio.get_running_loop().run_in_executor(None, read)
    except ValueError as exc:
        raise invalid("group", str(exc)) from None
    except sqlite3.Error as exc:
        raise APIError(503, f"the usage ledger cannot be read now: {exc}", code="ledger_unavailable") from None
    if fmt == "csv":
        return Response(to_csv(names, rows), media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": 'attachment; filename="usage.csv"'})
    return json_response({"object": "usage", "since": since, "until": until, "group": group,
                          "data": to_json(names, rows)})


async def dashboard_route(request: Request, state: ServerState) -> Response:
    """GET /dashboard: the page (index.html)."""
    return Response((DASHBOARD_DIR / "index.html").read_bytes(), media_type="text/html; charset=utf-8",
                    headers=PAGE_HEADERS)


async def dashboard_asset_route(request: Request, state: ServerState) -> Response:
    """GET /dashboard/{name}: one of the page's own files (ASSETS), with its type; 404 for any other name."""
    name = request.path_params["name"]
    kind = ASSETS.get(name)
    if kind is None:
        raise APIError(404, f"GET /dashboard/{name}: not_found", code="not_found")
    return Response((DASHBOARD_DIR / name).read_bytes(), media_type=kind, headers=PAGE_HEADERS)
