"""OpenAI Responses API: `POST /v1/responses`, whole and streamed, stateless but for `previous_response_id`.

The body becomes a chat request (tandem/server/responses_request.py), so the Responses API shares the chat
pipeline. Output items: reasoning ({type: reasoning, content: [reasoning_text]}), message ({content:
[output_text]}) and function_call ({call_id, name, arguments}). The stream is the typed event sequence
(response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / .done, response.reasoning_text.delta / .done, response.function_call_arguments.delta
/ .done, response.content_part.done, response.output_item.done, then response.completed or response.incomplete),
each with a `sequence_number`. With `store` (the default) the conversation is kept in a bounded in-memory store,
so a later request's `previous_response_id` continues it. Reference: the Responses API and its streaming events
(platform.openai.com/docs/api-reference/responses).
"""

from __future__ import annotations

import time
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tandem.server.agent_request import EFFORT_BUDGETS
from tandem.server.api_rules import check_responses
from tandem.server.drive import Tracker, plan_in_thread, single_choice, with_keepalive
from tandem.server.errors import APIError, internal_error
from tandem.server.protocol import decode_body, parse_chat, shown_names
from tandem.server.responses import ChoiceOutput, Event
from tandem.server.responses_request import ResponseStore, namespace_members, to_chat_body
from tandem.server.runner import Plan
from tandem.server.state import json_response, read_body
from tandem.server.tool_parser import ToolCall

if TYPE_CHECKING:
    from tandem.server.state import ServerState

log = logging.getLogger("tandem.server")


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseBuilder:
    """The output items of one response, built from the pipeline's events (whole or streamed)."""

    def __init__(self, body: dict[str, Any], rid: str, model: str, plan: Plan, tracker: Tracker) -> None:
        self.body, self.rid, self.model, self.plan, self.tracker = body, rid, model, plan, tracker
        self.items: list[dict[str, Any]] = []
        self.created = int(time.time())
        self.seq = 0
        self.open_kind: str | None = None
        self.namespaces = namespace_members(body.get("tools"))
        include = body.get("include")
        self.encrypted = isinstance(include, list) and "reasoning.encrypted_content" in include

    def envelope(self, status: str, output: ChoiceOutput | None = None) -> dict[str, Any]:
        """The response object (status in_progress / completed / incomplete)."""
        b = self.body
        obj: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.items if status != "in_progress" else [], "error": None, "incomplete_details": None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls", True), "temperature": b.get("temperature"),
            "top_p": b.get("top_p"), "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "max_output_tokens": b.get("max_output_tokens"), "previous_response_id": b.get("previous_response_id"),
            "store": b.get("store", True), "text": b.get("text") or {"format": {"type": "text"}},
            "reasoning": b.get("reasoning") or {"effort": None, "summary": None}, "truncation": "disabled"}
        if status == "incomplete":
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        if output is not None:
            reasoning_tokens = self.tracker.reasoning_tokens.get(0, 0)
            prompt = len(self.plan.prompt_ids)
            obj["usage"] = {"input_tokens": prompt,
                            "input_tokens_details": {"cached_tokens": self.tracker.cached_tokens},
                            "output_tokens": output.num_tokens,
                            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                            "total_tokens": prompt + output.num_tokens}
        return obj

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event with its sequence number."""
        self.seq += 1
        return (b"event: " + kind.encode() + b"\ndata: " +
                orjson.dumps({"type": kind, "sequence_number": self.seq - 1, **fields}) + b"\n\n")

    def _open(self, kind: str) -> tuple[dict[str, Any], list[bytes]]:
        out = self.close()
        if kind == "reasoning":
            item: dict[str, Any] = {"type": "reasoning", "id": _new("rs"), "summary": [],
                                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"type": "message", "id": _new("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self.open_kind = kind
        n = len(self.items) - 1
        shown = {**item, "content": []}
        out.append(self.event("response.output_item.added", output_index=n, item=shown))
        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=n, content_index=0,
                              part=item["content"][0]))
        return item, out

    def close(self) -> list[bytes]:
        """Close the open reasoning or message item (its .done events)."""
        if self.open_kind is None:
            return []
        item, n = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        kind = "response.reasoning_text.done" if self.open_kind == "reasoning" else "response.output_text.done"
        extra: dict[str, Any] = {} if self.open_kind == "reasoning" else {"logprobs": []}
        item["status"] = "completed"
        if self.open_kind == "reasoning" and self.encrypted:  # the plain text: what a later turn sends back
            item["encrypted_content"] = part["text"]
        self.open_kind = None
        return [self.event(kind, item_id=item["id"], output_index=n, content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=n, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=n, item=item)]

    def feed(self, event: Event) -> list[bytes]:
        """Add one event to the items; return its stream events."""
        kind, value = event
        if kind == "call":
            return self._call(value)
        if not value:
            return []
        want = "reasoning" if kind == "reasoning" else "message"
        out: list[bytes] = []
        if self.open_kind != want:
            item, out = self._open(want)
        item = self.items[-1]
        item["content"][0]["text"] += value
        name = "response.reasoning_text.delta" if want == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if want == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                              delta=value, **extra))
        return out

    def _call(self, call: ToolCall) -> list[bytes]:
        out = self.close()
        item: dict[str, Any] = {"type": "function_call", "id": _new("fc"), "call_id": call.id, "name": call.name,
                                "arguments": call.arguments_json, "status": "completed"}
        if call.name in self.namespaces:
            item["namespace"], item["name"] = self.namespaces[call.name]
        self.items.append(item)
        n = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=n,
                              item={**item, "arguments": "", "status": "in_progress"}))
        for piece in call.argument_pieces():
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=n,
                                  delta=piece))
        out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=n,
                              name=call.name, arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=n, item=item))
        return out

    def conversation_tail(self) -> list[dict[str, Any]]:
        """This response's output as chat messages (for the store)."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "reasoning":
                msg["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                msg["content"] += item["content"][0]["text"]
            else:
                name = (item["namespace"] + "." + item["name"]) if item.get("namespace") else item["name"]
                msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": name, "arguments": item["arguments"]}})
        return [msg]


def _status(output: ChoiceOutput) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


async def responses_route(request: Request, state: ServerState) -> Response:
    """POST /v1/responses."""
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    store: ResponseStore = state.response_store
    parsed: list[tuple[dict[str, Any], list[Any]]] = []

    def parse() -> Any:
        body = decode_body(raw)
        check_responses(body)  # the Responses API's own ranges and enums (api_rules.py)
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise APIError(400, "'previous_response_id' must be a string", param="previous_response_id")
        history = store.get(prev) if prev else []
        default = EFFORT_BUDGETS["medium"] if state.options.reasoning_budget is None else None
        chat_body, conversation, ignored = to_chat_body(body, history, state.options.strict_fields, default)
        req = parse_chat(chat_body, strict=True)
        req.ignored = shown_names(ignored)
        parsed.append((body, conversation))
        return req

    record = request.state.record
    req, plan = await plan_in_thread(state, parse, record)
    body, conversation = parsed[0]
    tracker = Tracker(state, plan, record)
    job = await tracker.submit(request)
    output = ChoiceOutput(plan)
    builder = ResponseBuilder(body, _new("resp"), state.served_name, plan, tracker)
    keep = body.get("store", True) is not False

    def remember() -> None:
        if keep:
            store.put(builder.rid, conversation + builder.conversation_tail(),
                      builder.envelope(_status(output), output))

    if req.stream:
        return StreamingResponse(_stream(builder, tracker, job, output, remember), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async for events, _ in single_choice(tracker, job, output):
        for event in events:
            builder.feed(event)
    builder.close()
    remember()
    return json_response(builder.envelope(_status(output), output))


async def _stream(builder: ResponseBuilder, tracker: Tracker, job: Any, output: ChoiceOutput,
                  remember: Callable[[], None]) -> AsyncIterator[bytes]:
    yield builder.event("response.created", response=builder.envelope("in_progress"))
    yield builder.event("response.in_progress", response=builder.envelope("in_progress"))
    try:
        async for got in with_keepalive(single_choice(tracker, job, output)):
            if got is None:  # nothing yet (a long prefill): the in_progress event again keeps the stream alive
                yield builder.event("response.in_progress", response=builder.envelope("in_progress"))
                continue
            for event in got[0]:
                for piece in builder.feed(event):
                    yield piece
        for piece in builder.close():
            yield piece
        remember()
        status = _status(output)
        yield builder.event(f"response.{status}", response=builder.envelope(status, output))
    except Exception as exc:  # the status line is sent: report the failure in the stream
        err = exc if isinstance(exc, APIError) else internal_error(exc, log)
        yield builder.event("error", code=err.code, message=err.message, param=err.param)


async def get_response_route(request: Request, state: ServerState) -> Response:
    """GET /v1/responses/{id}: a stored response object (404 when not kept)."""
    return json_response(state.response_store.response(request.path_params["rid"]))


def responses_routes(state: ServerState, route: Callable[..., Any]) -> list[Route]:
    """The Responses routes (OpenAI's error shape)."""
    return [Route("/v1/responses", route("responses", responses_route, state), methods=["POST"]),
            Route("/v1/responses/{rid}", route("responses_get", get_response_route, state), methods=["GET"])]
