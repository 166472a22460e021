"""The Starlette app: OpenAI-compatible routes over one Engine (orjson for every body)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tandem.engine import Engine
from tandem.generation import GenerationChunk
from tandem.server.cache_api import CacheCollector, cache_route
from tandem.server.errors import APIError
from tandem.server.grammar import GrammarCompiler
from tandem.server.metrics import CONTENT_TYPE_LATEST, Metrics
from tandem.server.protocol import decode_body, parse_chat, parse_completion
from tandem.server.responses import ChoiceOutput, StreamWriter, new_id, stream_body, whole_response
from tandem.server.runner import make_plan, make_work
from tandem.server.scheduler import Scheduler

log = logging.getLogger("tandem.server")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response serialised by orjson."""
    return Response(orjson.dumps(obj), status_code=status, headers=headers, media_type="application/json")


def error_response(err: APIError) -> Response:
    """OpenAI's error shape with the error's status and headers."""
    return json_response(err.body(), err.status, err.headers())


class ServerState:
    """What the routes share: the engine, its scheduler, metrics and the lazily built grammar compiler."""

    def __init__(self, engine: Engine, served_name: str, max_queue: int, queue_timeout_s: float,
                 max_body_bytes: int) -> None:
        self.engine = engine
        self.served_name = served_name
        self.metrics = Metrics()
        self.metrics.registry.register(CacheCollector(engine))
        self.scheduler = Scheduler(max_queue, queue_timeout_s, self.metrics)
        self.max_body_bytes = max_body_bytes
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        """The llguidance compiler for this engine's tokenizer (built on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                if self.engine.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer, so grammars are unavailable")
                self._compiler = GrammarCompiler(self.engine.tokenizer, self.engine.vocab_size,
                                                 self.engine.eos_token_ids)
            return self._compiler


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; APIError 413 past `limit` bytes (the rest is drained so the client reads the answer)."""
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size <= limit:
            parts.append(part)
    if size > limit:
        raise APIError(413, f"the request body is {size} bytes; the limit is {limit}", code="body_too_large")
    return b"".join(parts)


def _route(name: str, fn: Callable[[Request, ServerState], Awaitable[Response]],
           state: ServerState) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        try:
            response = await fn(request, state)
        except APIError as err:
            response = error_response(err)
        except Exception as exc:  # never a bare 500 page: OpenAI's shape, and the log has the trace
            log.exception("request failed")
            response = error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        return response

    return handler


async def generate_route(request: Request, state: ServerState) -> Response:
    """POST /v1/chat/completions and /v1/completions."""
    arrived = time.perf_counter()
    chat = request.url.path.endswith("/chat/completions")
    body = decode_body(await read_body(request, state.max_body_bytes))
    req = parse_chat(body) if chat else parse_completion(body)
    if req.model is not None and req.model not in (state.served_name, state.engine.name):
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{state.served_name}'",
                       param="model", code="model_not_found")
    plan = make_plan(state.engine, state.compiler, req)
    state.metrics.prompt_tokens.inc(len(plan.prompt_ids))
    job = await state.scheduler.submit(make_work(state.engine, state.compiler, plan))
    outputs = [ChoiceOutput(plan) for _ in range(req.n)]
    first_at: dict[int, float] = {}

    def on_chunk(i: int, chunk: GenerationChunk, t: float) -> None:
        state.metrics.tokens_per_round.observe(len(chunk.token_ids))
        state.metrics.generated_tokens.inc(len(chunk.token_ids))
        if i not in first_at:
            first_at[i] = t
            if i == 0:
                state.metrics.ttft.observe(t - arrived)
        if chunk.finish_reason is not None and t > first_at[i]:
            state.metrics.tokens_per_s.observe((outputs[i].num_tokens - 1) / (t - first_at[i]))

    rid, model = new_id(req.kind), state.served_name
    if req.stream:
        writer = StreamWriter(state.engine, plan, rid, model)
        return StreamingResponse(stream_body(writer, job, outputs, on_chunk), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_watch_disconnect(request, job.cancel))
    try:
        async for kind, value in job.items():
            if kind == "chunk":
                i, chunk, t = value
                outputs[i].feed(chunk)
                on_chunk(i, chunk, t)
    finally:
        watcher.cancel()
        job.cancel()
    return json_response(whole_response(state.engine, plan, outputs, rid, model))


async def _watch_disconnect(request: Request, cancel: Callable[[], None]) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
    cancel()


async def models_route(request: Request, state: ServerState) -> Response:
    """GET /v1/models."""
    return json_response({"object": "list", "data": [
        {"id": state.served_name, "object": "model", "created": 0, "owned_by": "tandem",
         "max_model_len": state.engine.max_context}]})


async def health_route(request: Request, state: ServerState) -> Response:
    """GET /health: 200 {"status": "ok"}, or 503 {"status": "draining"} after SIGTERM."""
    s = state.scheduler
    body = {"status": "draining" if s.draining else "ok", "running": s.num_running, "waiting": s.num_waiting}
    return json_response(body, 503 if s.draining else 200)


async def metrics_route(request: Request, state: ServerState) -> Response:
    """GET /metrics: Prometheus text."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return error_response(APIError(status, f"{request.method} {request.url.path}: {code or 'error'}", code=code))


def create_app(engine: Engine, *, served_name: str | None = None, max_queue: int = 8,
               queue_timeout_s: float = 60.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The ASGI app serving `engine`; `app.state.tandem` is its ServerState."""
    state = ServerState(engine, served_name or engine.name, max_queue, queue_timeout_s, max_body_bytes)
    routes = [
        Route("/v1/chat/completions", _route("chat", generate_route, state), methods=["POST"]),
        Route("/v1/completions", _route("completions", generate_route, state), methods=["POST"]),
        Route("/v1/models", _route("models", models_route, state), methods=["GET"]),
        Route("/health", _route("health", health_route, state), methods=["GET"]),
        Route("/metrics", _route("metrics", metrics_route, state), methods=["GET"]),
        Route("/v1/cache", _route("cache", lambda r, s: cache_route(r, s.engine), state), methods=["GET", "DELETE"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.tandem = state
    return app
