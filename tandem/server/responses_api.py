"""OpenAI Responses API over HTTP: `POST /v1/responses` (whole and streamed), `GET /v1/responses/{id}`,
`POST /v1/responses/compact`; and the route table, with the WebSocket mode on `/v1/responses`
(responses_socket.py).

The body becomes a chat request (tandem/server/responses_request.py), so the Responses API shares the chat
pipeline; a turn's life is responses_turn.py, its response object and events responses_events.py. Output items:
reasoning ({type: reasoning, content: [reasoning_text]}), message ({content: [output_text]}), function_call
({call_id, name, arguments}) and, for a compaction, compaction. The stream is the typed event sequence
(response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / .done, response.reasoning_text.delta / .done (Open Responses' names with
`--responses-events open-responses`), response.function_call_arguments.delta / .done, response.content_part.done,
response.output_item.done, then response.completed or response.incomplete), each with a `sequence_number`. With
`store` (the default) the conversation is kept in a bounded in-memory store, so a later request's
`previous_response_id` continues it. Reference: the Responses API and its streaming events
(platform.openai.com/docs/api-reference/responses); Open Responses (openresponses.org).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute

from tandem.server.drive import Tracker, plan_in_thread, single_choice
from tandem.server.errors import invalid
from tandem.server.protocol import GenerationRequest, decode_body, parse_chat, shown_names
from tandem.server.responses import ChoiceOutput
from tandem.server.responses_compact import COMPACT_FIELDS, compacted_output, compaction_chat_body
from tandem.server.responses_events import new_id, sse
from tandem.server.responses_request import to_chat_body
from tandem.server.responses_socket import responses_socket
from tandem.server.responses_turn import TurnRun, prepare_turn, store_response
from tandem.server.state import json_response, read_body

if TYPE_CHECKING:
    from tandem.server.state import ServerState


async def responses_route(request: Request, state: ServerState) -> Response:
    """POST /v1/responses."""
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    record = request.state.record
    turn = await prepare_turn(state, raw, record, state.response_store.get)
    run = TurnRun(state, turn, record, lambda r: store_response(state, r))
    await run.start(request)
    if turn.req.stream:
        return StreamingResponse(_stream(run), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async for _ in run.events(keepalive=False):
        pass
    if run.error is not None:
        raise run.error
    return json_response(run.builder.envelope(run.status, run.output))


async def _stream(run: TurnRun) -> AsyncIterator[bytes]:
    async for event in run.events():
        yield sse(event)


async def get_response_route(request: Request, state: ServerState) -> Response:
    """GET /v1/responses/{id}: a stored response object (404 when not kept)."""
    return json_response(state.response_store.response(request.path_params["rid"]))


async def compact_route(request: Request, state: ServerState) -> Response:
    """POST /v1/responses/compact: the conversation (input items and / or previous_response_id) compacted into its
    user messages and one compaction item the model writes (responses_compact.py). 400 without `model`."""
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    record = request.state.record
    parsed: list[list[dict[str, Any]]] = []

    def parse() -> GenerationRequest:
        body = decode_body(raw)
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise invalid("model", "'model' is required (a string naming the served model)")
        unknown = sorted(k for k in body if k not in COMPACT_FIELDS)
        if unknown and state.options.strict_fields:
            raise invalid(unknown[0], f"unknown field '{unknown[0]}'")
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise invalid("previous_response_id", "'previous_response_id' must be a string")
        history = state.response_store.get(prev) if prev else []
        given = {k: body[k] for k in ("model", "instructions", "max_output_tokens") if body.get(k) is not None}
        chat, conversation, _ = to_chat_body({**given, "input": body.get("input") or []}, history, False,
                                             allow_image_urls=state.allow_image_urls)
        req = parse_chat(compaction_chat_body(chat, state.engine.max_context), strict=True,
                         allow_image_urls=state.allow_image_urls)
        req.ignored = shown_names(unknown)
        parsed.append(conversation)
        return req

    created = int(time.time())
    _, plan = await plan_in_thread(state, parse, record)
    tracker = Tracker(state, plan, record)
    job = await tracker.submit(request)
    output = ChoiceOutput(plan)
    async for _ in single_choice(tracker, job, output):
        pass
    prompt = len(plan.prompt_ids)
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": tracker.cached_tokens},
             "output_tokens": output.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt + output.num_tokens}
    return json_response({"id": new_id("resp"), "object": "response.compaction", "created_at": created,
                          "output": compacted_output(parsed[0], "".join(output.content).strip()), "usage": usage})


def responses_routes(state: ServerState, route: Callable[..., Any]) -> list[BaseRoute]:
    """The Responses routes (OpenAI's error shape), the WebSocket mode beside the POST route."""
    async def socket(websocket: Any) -> None:
        await responses_socket(websocket, state)

    return [Route("/v1/responses", route("responses", responses_route, state), methods=["POST"]),
            WebSocketRoute("/v1/responses", socket),
            Route("/v1/responses/compact", route("responses_compact", compact_route, state), methods=["POST"]),
            Route("/v1/responses/{rid}", route("responses_get", get_response_route, state), methods=["GET"])]
