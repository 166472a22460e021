"""Anthropic Messages API: `POST /v1/messages` (whole and streamed) and `POST /v1/messages/count_tokens`.

A Messages body is translated to the chat request the OpenAI route takes (system prompt, text / tool_use /
tool_result / thinking blocks, tools with `input_schema`, tool_choice auto / any / tool / none, stop_sequences,
sampling, `thinking: {type, budget_tokens}` as the thinking budget), so both APIs share one plan and pipeline.
Image blocks (base64; url sources with `--allow-image-urls`) go in as the chat route's images, also inside
tool_result blocks, and count_tokens counts their tokens; binary documents are refused with a 400. `model` is required, as Anthropic requires it, and any name is
accepted (agents send their own); the reply names the model asked for. Errors use Anthropic's shape:
{"type": "error", "error": {"type", "message"}}. The stream is Anthropic's event sequence: message_start, ping,
content_block_start / _delta (text_delta, thinking_delta, input_json_delta) / _stop per block, message_delta
(stop_reason, cumulative usage), message_stop.
Reference: the Messages API and its streaming page (docs.anthropic.com).
"""

from __future__ import annotations

import asyncio

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tandem.server.anthropic_request import to_chat_body
from tandem.server.api_rules import check_anthropic
from tandem.server.drive import Tracker, plan_in_thread, single_choice, with_keepalive
from tandem.server.errors import APIError, internal_error
from tandem.server.image_urls import fetch_image_urls
from tandem.server.protocol import decode_body, parse_chat, shown_names
from tandem.server.responses import ChoiceOutput, Event
from tandem.server.runner import Plan, render_prompt
from tandem.server.state import json_response, read_body
from tandem.server.tool_parser import ToolCall

if TYPE_CHECKING:
    from tandem.server.state import ServerState

log = logging.getLogger("tandem.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error object for an APIError."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def anthropic_error(err: APIError) -> Response:
    """Anthropic's error response (status and Retry-After kept)."""
    return Response(orjson.dumps(anthropic_error_body(err)), status_code=err.status, headers=err.headers(),
                    media_type="application/json")


def _stop_reason(plan: Plan, output: ChoiceOutput, chunk_ids: list[int], all_ids: list[int],
                 state: ServerState) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the OpenAI finish reason and the last token."""
    finish = output.finish_reason or "stop"
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    stops = plan.request.params.stop or []
    if stops and not (chunk_ids and chunk_ids[-1] in state.engine.eos_token_ids):
        text = state.engine.tokenizer.decode(all_ids) if state.engine.tokenizer is not None else ""
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def _usage(plan: Plan, output_tokens: int, tracker: Tracker) -> dict[str, int]:
    cached = tracker.cached_tokens
    return {"input_tokens": len(plan.prompt_ids) - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


def _interleaved(request: Request) -> bool:
    """Whether the anthropic-beta header (a comma-separated list) names interleaved thinking, under which the
    thinking budget may exceed max_tokens."""
    betas = request.headers.get("anthropic-beta", "")
    return any(b.strip().startswith("interleaved-thinking-") for b in betas.split(","))


def _parse(raw: bytes, state: ServerState, count_only: bool = False, interleaved: bool = False
           ) -> tuple[dict[str, Any], Any]:
    body = decode_body(raw)
    check_anthropic(body, count_only, interleaved)  # Anthropic's own ranges and enums (api_rules.py)
    chat_body, ignored = to_chat_body(body, state.options.default_template_kwargs, state.options.strict_fields,
                                      count_only, state.allow_image_urls)
    req = parse_chat(chat_body, strict=True, allow_image_urls=state.allow_image_urls)
    req.ignored = shown_names(ignored)
    return body, req


async def messages_route(request: Request, state: ServerState) -> Response:
    """POST /v1/messages."""
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    record = request.state.record
    parsed: list[dict[str, Any]] = []
    interleaved = _interleaved(request)

    def parse() -> Any:
        body, req = _parse(raw, state, interleaved=interleaved)
        parsed.append(body)
        return req

    req, plan = await plan_in_thread(state, parse, record)
    body = parsed[0]
    tracker = Tracker(state, plan, record)
    job = await tracker.submit(request)
    output = ChoiceOutput(plan)
    mid = "msg_" + uuid.uuid4().hex[:24]
    model = str(body["model"])  # required (api_rules.check_anthropic); any name is served
    if req.stream:
        return StreamingResponse(_stream(state, plan, tracker, job, output, mid, model),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    content: list[dict[str, Any]] = []
    last_ids: list[int] = []
    all_ids: list[int] = []
    async for events, chunk in single_choice(tracker, job, output):
        last_ids, all_ids = chunk.token_ids, all_ids + chunk.token_ids
        for kind, value in events:
            if kind == "call":
                content.append(_tool_block(value))
            elif content and content[-1]["type"] == ("thinking" if kind == "reasoning" else "text"):
                content[-1]["thinking" if kind == "reasoning" else "text"] += value
            elif kind == "reasoning":
                content.append({"type": "thinking", "thinking": value, "signature": ""})
            else:
                content.append({"type": "text", "text": value})
    reason, seq = _stop_reason(plan, output, last_ids, all_ids, state)
    return json_response({"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
                          "stop_reason": reason, "stop_sequence": seq,
                          "usage": _usage(plan, output.num_tokens, tracker)})


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **obj}) + b"\n\n"


class _Blocks:
    """Open / delta / close events of the streamed content blocks, one block per kind run."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def keepalive(self, reasoning: bool) -> list[bytes]:
        """A ping and an empty delta of the open block (opening the block the reply starts with: thinking when the
        prompt ends inside the think block, else text). Clients drop pings before the application sees them, and
        an agent whose stream shows no event for minutes gives up (Claude Code: 300 s), so the delta is what
        tells it the reply is coming."""
        kind = self.kind or ("thinking" if reasoning else "text")
        out = [_event("ping", {})]
        if self.kind is None:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out += self.open(kind, block)
        if self.kind in ("thinking", "text"):
            delta = {"type": "thinking_delta", "thinking": ""} if self.kind == "thinking" else \
                {"type": "text_delta", "text": ""}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def feed(self, event: Event) -> list[bytes]:
        kind, value = event
        if kind == "call":
            call: ToolCall = value
            out = self.open("tool_use", {**_tool_block(call), "input": {}})
            for piece in call.argument_pieces():
                out.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": piece}}))
            return out + self.close()
        out = []
        if kind == "reasoning" and self.kind != "thinking":
            out = self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        elif kind == "content" and self.kind != "text":
            out = self.open("text", {"type": "text", "text": ""})
        delta = {"type": "thinking_delta", "thinking": value} if kind == "reasoning" else \
            {"type": "text_delta", "text": value}
        return out + [_event("content_block_delta", {"index": self.index, "delta": delta})]


async def _stream(state: ServerState, plan: Plan, tracker: Tracker, job: Any, output: ChoiceOutput, mid: str,
                  model: str) -> AsyncIterator[bytes]:
    blocks = _Blocks()
    last_ids: list[int] = []
    all_ids: list[int] = []
    yield _event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {**_usage(plan, 0, tracker), "output_tokens": 0}}})
    yield _event("ping", {})
    try:
        async for got in with_keepalive(single_choice(tracker, job, output)):
            if got is None:  # nothing yet (a long prefill): keep the stream alive
                for piece in blocks.keepalive(plan.in_reasoning and not plan.inline_reasoning):
                    yield piece
                continue
            events, chunk = got
            last_ids, all_ids = chunk.token_ids, all_ids + chunk.token_ids
            for event in events:
                if event[1] == "":
                    continue
                for piece in blocks.feed(event):
                    yield piece
        for piece in blocks.close():
            yield piece
        reason, seq = _stop_reason(plan, output, last_ids, all_ids, state)
        # the usage is cumulative, as Anthropic's: message_start went out before the cache lookup
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                       "usage": _usage(plan, output.num_tokens, tracker)})
        yield _event("message_stop", {})
    except Exception as exc:  # the status line is sent: report the failure as an error event
        err = exc if isinstance(exc, APIError) else internal_error(exc, log)
        yield _event("error", {"error": anthropic_error_body(err)["error"]})


async def count_tokens_route(request: Request, state: ServerState) -> Response:
    """POST /v1/messages/count_tokens: {"input_tokens": N}."""
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)

    def parse() -> Any:
        _, req = _parse(raw, state, count_only=True)
        req.chat_template_kwargs = {**state.options.default_template_kwargs, **req.chat_template_kwargs}
        return req

    loop = asyncio.get_running_loop()
    lane = state.lane(len(raw))
    req = await loop.run_in_executor(lane, parse)
    await fetch_image_urls(state, req)  # image URLs (--allow-image-urls): fetched off the lane, then counted
    num_tokens = await loop.run_in_executor(lane, lambda: len(render_prompt(state.engine, req)))
    request.state.record.ignored = list(req.ignored)
    return json_response({"input_tokens": num_tokens})


def anthropic_routes(state: ServerState, route: Callable[..., Any]) -> list[Route]:
    """The Messages routes, their errors in Anthropic's shape."""
    return [Route("/v1/messages", route("messages", messages_route, state, anthropic_error), methods=["POST"]),
            Route("/v1/messages/count_tokens", route("count_tokens", count_tokens_route, state, anthropic_error),
                  methods=["POST"])]
