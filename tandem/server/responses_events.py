"""One Responses API response as it is built: its output items, the response object and the stream's typed events.

The response object carries every field both specs require: OpenAI's `Response` (platform.openai.com/docs/
api-reference/responses/object) and Open Responses' `ResponseResource` (openresponses.org, the compliance suite's
schema): `created_at` and `completed_at`, the sampling parameters as applied (`temperature`, `top_p`,
`presence_penalty`, `frequency_penalty`, `top_logprobs`), `max_output_tokens`, `max_tool_calls`, `background`,
`service_tier`, `safety_identifier`, `prompt_cache_key`, the function tools echoed with `description`, `parameters`
and `strict`, and `usage` on every event that carries the response (the tokens so far).

Events are dicts (`event`); `sse` writes one as a server-sent event, the WebSocket mode sends its JSON. The two specs
name one pair of events apart: the reasoning text's deltas are `response.reasoning_text.delta` / `.done` in
OpenAI's API (what Codex and the `openai` SDK parse; the default) and `response.reasoning.delta` / `.done` in Open
Responses (`--responses-events open-responses`). An error event carries both shapes: OpenAI's `code`, `message`,
`param` beside Open Responses' `error` object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from tandem.server.drive import Tracker
from tandem.server.errors import APIError
from tandem.server.responses import ChoiceOutput, Event
from tandem.server.responses_request import HOSTED_TOOLS, namespace_members
from tandem.server.runner import Plan
from tandem.server.tool_parser import ToolCall

EVENT_STYLES = ("openai", "open-responses")
_REASONING_EVENTS = {"openai": ("response.reasoning_text.delta", "response.reasoning_text.done"),
                     "open-responses": ("response.reasoning.delta", "response.reasoning.done")}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable", 500: "server_error"}


def new_id(prefix: str) -> str:
    """A fresh id: `<prefix>_` and 24 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def sse(event: dict[str, Any]) -> bytes:
    """One event as a server-sent event (its type on the `event:` line)."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def error_fields(err: APIError) -> dict[str, Any]:
    """An error event's fields in both shapes: OpenAI's `code`, `message`, `param` and Open Responses' `error`."""
    inner = {"type": _ERROR_TYPES.get(err.status, "invalid_request_error"), "code": err.code or "error",
             "message": err.message, "param": err.param}
    return {"code": inner["code"], "message": err.message, "param": err.param, "error": inner}


def echo_tools(raw: Any) -> list[Any]:
    """The request's tools as the response echoes them: function tools with `description`, `parameters` and
    `strict` (default true: the grammar holds every call to its schema), namespaces as sent; the hosted tools the
    server dropped left out."""
    out: list[Any] = []
    for tool in raw if isinstance(raw, list) else []:
        if isinstance(tool, dict) and tool.get("type") in HOSTED_TOOLS:
            continue
        if isinstance(tool, dict) and tool.get("type") == "function":
            tool = {**tool, "description": tool.get("description"), "parameters": tool.get("parameters"),
                    "strict": tool.get("strict", True)}
        out.append(tool)
    return out


class ResponseBuilder:
    """The output items of one response, built from the pipeline's events (whole, streamed or over a WebSocket).

    Args:
        body: the request body (its fields are echoed).
        rid: the response id.
        model: the served model name.
        plan: the request's plan (the sampling parameters as applied, the prompt's length).
        tracker: counts the reasoning and cached tokens.
        style: "openai" or "open-responses" (EVENT_STYLES): the reasoning events' names.
    """

    def __init__(self, body: dict[str, Any], rid: str, model: str, plan: Plan, tracker: Tracker,
                 style: str = "openai") -> None:
        self.body, self.rid, self.model, self.plan, self.tracker = body, rid, model, plan, tracker
        self.items: list[dict[str, Any]] = []
        self.created = int(time.time())
        self.completed_at: int | None = None
        self.seq = 0
        self.open_kind: str | None = None
        self.namespaces = namespace_members(body.get("tools"))
        include = body.get("include")
        self.encrypted = isinstance(include, list) and "reasoning.encrypted_content" in include
        self.reasoning_delta, self.reasoning_done = _REASONING_EVENTS[style]
        self.tools = echo_tools(body.get("tools"))

    def envelope(self, status: str, output: ChoiceOutput | None = None) -> dict[str, Any]:
        """The response object (status queued / in_progress / completed / incomplete / failed)."""
        b, params = self.body, self.plan.request.params
        reasoning: dict[str, Any] = b["reasoning"] if isinstance(b.get("reasoning"), dict) else {}
        text: dict[str, Any] = b["text"] if isinstance(b.get("text"), dict) else {}
        done = status in ("completed", "incomplete", "failed")
        if done and self.completed_at is None:
            self.completed_at = int(time.time())
        obj: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created,
            "completed_at": self.completed_at if done else None, "status": status, "model": self.model,
            "output": self.items if status != "in_progress" else [], "error": None, "incomplete_details": None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "temperature": params.temperature, "top_p": params.top_p,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "top_logprobs": 0, "tool_choice": b.get("tool_choice") or "auto", "tools": self.tools,
            "max_output_tokens": b.get("max_output_tokens"), "max_tool_calls": b.get("max_tool_calls"),
            "previous_response_id": b.get("previous_response_id"), "store": b.get("store") is not False,
            "background": False, "service_tier": "default", "safety_identifier": b.get("safety_identifier"),
            "prompt_cache_key": b.get("prompt_cache_key"), "user": b.get("user"),
            "text": {**text, "format": text.get("format") or {"type": "text"}},
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "truncation": b.get("truncation") or "disabled", "usage": self.usage(output)}
        if status == "incomplete":
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        return obj

    def usage(self, output: ChoiceOutput | None) -> dict[str, Any]:
        """The token counts so far (all zero but the prompt before the first token)."""
        done = output.num_tokens if output is not None else 0
        prompt = len(self.plan.prompt_ids)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.tracker.cached_tokens},
                "output_tokens": done,
                "output_tokens_details": {"reasoning_tokens": self.tracker.reasoning_tokens.get(0, 0)},
                "total_tokens": prompt + done}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One event with its sequence number."""
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def error(self, err: APIError) -> dict[str, Any]:
        """The error event of a failure mid-response."""
        return self.event("error", **error_fields(err))

    def _open(self, kind: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        out = self.close()
        if kind == "reasoning":
            item: dict[str, Any] = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self.open_kind = kind
        n = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=n, item={**item, "content": []}))
        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=n, content_index=0,
                              part=item["content"][0]))
        return item, out

    def close(self) -> list[dict[str, Any]]:
        """Close the open reasoning or message item (its .done events)."""
        if self.open_kind is None:
            return []
        item, n = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        reasoning = self.open_kind == "reasoning"
        kind = self.reasoning_done if reasoning else "response.output_text.done"
        extra: dict[str, Any] = {} if reasoning else {"logprobs": []}
        item["status"] = "completed"
        if reasoning and self.encrypted:  # the plain text: what a later turn sends back
            item["encrypted_content"] = part["text"]
        self.open_kind = None
        return [self.event(kind, item_id=item["id"], output_index=n, content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=n, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=n, item=item)]

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """Add one pipeline event to the items; return its stream events."""
        kind, value = event
        if kind == "call":
            return self._call(value)
        if not value:
            return []
        want = "reasoning" if kind == "reasoning" else "message"
        out: list[dict[str, Any]] = []
        if self.open_kind != want:
            _, out = self._open(want)
        item = self.items[-1]
        item["content"][0]["text"] += value
        name = self.reasoning_delta if want == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if want == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                              delta=value, **extra))
        return out

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        out = self.close()
        item: dict[str, Any] = {"type": "function_call", "id": new_id("fc"), "call_id": call.id,
                                "name": call.name, "arguments": call.arguments_json, "status": "completed"}
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

    def compaction(self, summary: str) -> list[dict[str, Any]]:
        """The one output item of a compaction (responses_compact.py): its added and done events."""
        item = {"type": "compaction", "id": new_id("cmp"), "encrypted_content": summary}
        self.items.append(item)
        n = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=n, item={**item, "encrypted_content": ""}),
                self.event("response.output_item.done", output_index=n, item=item)]

    def conversation_tail(self) -> list[dict[str, Any]]:
        """This response's output as chat messages (for the store)."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "reasoning":
                msg["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                msg["content"] += item["content"][0]["text"]
            elif item["type"] == "function_call":
                name = (item["namespace"] + "." + item["name"]) if item.get("namespace") else item["name"]
                msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": name, "arguments": item["arguments"]}})
        return [msg]
