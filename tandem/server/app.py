"""The Starlette app: OpenAI-compatible routes over one Engine (orjson for every body)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tandem.engine import Engine
from tandem.generation import GenerationChunk
from tandem.server.activity_api import (activity_route, activity_stream_route, dashboard_asset_route,
                                        dashboard_route, usage_route)
from tandem.server.drive import Tracker, plan_in_thread
from tandem.server.api_rules import check_openai
from tandem.server.cache_api import cache_route
from tandem.server.api_fields import rename_param
from tandem.server.errors import APIError, internal_error
from tandem.server.guard import RequestGuard
from tandem.server.metrics import CONTENT_TYPE_LATEST
from tandem.server.options import ServerOptions
from tandem.server.protocol import GenerationRequest, decode_body, parse_chat, parse_completion
from tandem.server.reqlog import RequestRecord, logged_stream
from tandem.server.responses import ChoiceOutput, StreamWriter, new_id, stream_body, whole_response
from tandem.server.tenants import check_tenant
from tandem.server.state import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, ServerState, error_response,
                                 json_response, read_body)

log = logging.getLogger("tandem.server")


_OPEN_ROUTES = {"health", "metrics", "dashboard"}  # the page holds no data: its reads are keyed
IGNORED_HEADER = "X-Tandem-Ignored-Fields"
MAX_LOGGED_CHARS = 200  # of a 4xx's message in its warning line


def _route(name: str, fn: Callable[[Request, ServerState], Awaitable[Response]], state: ServerState,
           render: Callable[[APIError], Response] = error_response) -> Callable[[Request], Awaitable[Response]]:
    """The handler of one route: the API key check naming the tenant (all but /health, and /metrics unless
    --metrics-auth), errors in the API's shape
    (`render`), the request counter, the ignored-fields header and warning, and the per-request log line."""
    async def handler(request: Request) -> Response:
        record = RequestRecord(name)
        request.state.record = record
        try:
            if name not in _OPEN_ROUTES or (name == "metrics" and state.options.metrics_auth):
                record.tenant = check_tenant(request, state.options.tenants)
            record.agent = _agent(request)
            response = await fn(request, state)
        except APIError as err:
            err = rename_param(name, err)
            response = render(err)
            if 400 <= err.status < 500:  # why, in one bounded line (the client has the whole message)
                log.warning("%s %d: %s%s", name, err.status, f"{err.param}: " if err.param else "",
                            err.message[:MAX_LOGGED_CHARS].encode("unicode_escape").decode("ascii"))
        except Exception as exc:  # never a bare 500 page: the API's shape; the trace goes to the log only
            response = render(internal_error(exc, log))
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        record.status = response.status_code
        if record.ignored:  # the routes' parsers give the names escaped to printable ASCII (protocol.shown_names)
            log.warning("%s: ignored unknown fields: %s (--strict-fields refuses them)", name, ", ".join(record.ignored))
            response.headers[IGNORED_HEADER] = ",".join(record.ignored)
        if name in _OPEN_ROUTES:
            return response
        if isinstance(response, StreamingResponse):
            response.body_iterator = logged_stream(response.body_iterator, record)
        else:
            record.done()
        return response

    return handler


MAX_AGENT_CHARS = 64


def _agent(request: Request) -> str | None:
    """The User-Agent's first product name, without its version ("claude-cli/2.0.1 (external)" -> "claude-cli",
    "python-httpx/0.28" -> "python-httpx"), printable and bounded; None without one."""
    name = request.headers.get("user-agent", "").strip().split(" ", 1)[0].split("/", 1)[0]
    return "".join(c for c in name if c.isprintable())[:MAX_AGENT_CHARS] or None


async def generate_route(request: Request, state: ServerState) -> Response:
    """POST /v1/chat/completions and /v1/completions."""
    chat = request.url.path.endswith("/chat/completions")
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    strict = state.options.strict_fields
    record: RequestRecord = request.state.record

    def parse() -> GenerationRequest:
        body = decode_body(raw)
        check_openai(body, chat)
        return parse_chat(body, strict, state.allow_image_urls) if chat else parse_completion(body, strict)

    req, plan = await plan_in_thread(state, parse, record)
    tracker = Tracker(state, plan, record)
    job = await tracker.submit(request)
    outputs = [ChoiceOutput(plan) for _ in range(req.n)]

    def on_chunk(i: int, chunk: GenerationChunk, t: float) -> None:
        tracker.on_chunk(i, chunk, t, outputs[i].finish_reason)

    rid, model = new_id(req.kind), state.served_name
    if req.stream:  # the streaming response watches for the disconnect itself from here on
        tracker.stop_watching()
        writer = StreamWriter(state.engine, plan, rid, model)
        return StreamingResponse(stream_body(writer, job, outputs, on_chunk), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        async for kind, value in job.items():
            if kind == "chunk":
                i, chunk, t = value
                outputs[i].feed(chunk)
                on_chunk(i, chunk, t)
    finally:
        tracker.stop_watching()
        job.cancel()
    return json_response(whole_response(state.engine, plan, outputs, rid, model))


async def models_route(request: Request, state: ServerState) -> Response:
    """GET /v1/models."""
    return json_response({"object": "list", "data": [
        {"id": state.served_name, "object": "model", "created": 0, "owned_by": "tandem",
         "max_model_len": state.engine.max_context}]})


async def health_route(request: Request, state: ServerState) -> Response:
    """GET /health: 200 {"status": "ok", "slots", "running", "waiting"}, or 503 {"status": "draining"} after
    SIGTERM."""
    s = state.scheduler
    body = {"status": "draining" if s.draining else "ok", "slots": s.slots, "running": s.num_running,
            "waiting": s.num_waiting}
    return json_response(body, 503 if s.draining else 200)


async def metrics_route(request: Request, state: ServerState) -> Response:
    """GET /metrics: Prometheus text."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return error_response(APIError(status, f"{request.method} {request.url.path}: {code or 'error'}", code=code))


def create_app(engine: Engine, *, served_name: str | None = None, max_queue: int = 8,
               queue_timeout_s: float = 60.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, bound_host: str = "127.0.0.1",
               allowed_hosts: Sequence[str] = (), allowed_origins: Sequence[str] = (),
               options: ServerOptions | None = None) -> Starlette:
    """The ASGI app serving `engine`; `app.state.tandem` is its ServerState.

    Every request passes `RequestGuard` first (Host, Origin, Content-Type: guard.py); CORS headers are sent only
    for `allowed_origins` (none by default)."""
    from tandem.server.anthropic import anthropic_routes
    from tandem.server.responses_api import responses_routes
    from tandem.server.tokenize_api import tokenize_routes

    state = ServerState(engine, served_name or engine.name, max_queue, queue_timeout_s, max_body_bytes, options,
                        body_timeout_s)
    routes = [*anthropic_routes(state, _route), *responses_routes(state, _route), *tokenize_routes(state, _route),
        Route("/v1/chat/completions", _route("chat", generate_route, state), methods=["POST"]),
        Route("/v1/completions", _route("completions", generate_route, state), methods=["POST"]),
        Route("/v1/models", _route("models", models_route, state), methods=["GET"]),
        Route("/health", _route("health", health_route, state), methods=["GET"]),
        Route("/metrics", _route("metrics", metrics_route, state), methods=["GET"]),
        Route("/v1/cache", _route("cache", lambda r, s: cache_route(r, s.engine), state), methods=["GET", "DELETE"]),
        Route("/v1/activity", _route("activity", activity_route, state), methods=["GET"]),
        Route("/v1/activity/stream", _route("activity", activity_stream_route, state), methods=["GET"]),
        Route("/v1/usage", _route("usage", usage_route, state), methods=["GET"]),
        Route("/dashboard", _route("dashboard", dashboard_route, state), methods=["GET"]),
        Route("/dashboard/{name}", _route("dashboard", dashboard_asset_route, state), methods=["GET"]),
    ]
    middleware = [Middleware(RequestGuard, bound_host=bound_host, allowed_hosts=allowed_hosts,
                             allowed_origins=allowed_origins)]
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"]))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
    app.state.tandem = state
    return app
