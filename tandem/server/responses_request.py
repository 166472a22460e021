"""OpenAI Responses request body -> the chat body `parse_chat` validates; and the bounded store of recent
responses that `previous_response_id` names.

Mapping: `instructions` -> a system message first; `input` a string -> one user message; input items: messages
(role user / system / developer / assistant; content a string or input_text / output_text parts), function_call ->
an assistant tool call, function_call_output -> a tool message, reasoning -> the next assistant message's
reasoning_content. tools[] {type: function, name, parameters} -> chat tools; tool_choice as in chat ({type:
function, name} for a named one); text.format json_schema / json_object -> response_format; max_output_tokens ->
max_tokens. Images and files are refused (400).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from tandem.server.errors import APIError, invalid

RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                    "reasoning", "metadata", "user", "include", "truncation", "service_tier", "prompt_cache_key",
                    "safety_identifier", "background", "top_logprobs", "stream_options", "max_tool_calls",
                    "cache_salt"}


class ResponseStore:
    """The last `capacity` stored responses: id -> the conversation (chat messages) up to and including its
    output. Thread-safe; the oldest is dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict[str, Any]]) -> None:
        """Keep `messages` under `rid` (dropping the oldest past capacity)."""
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[rid] = messages
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> list[dict[str, Any]]:
        """The conversation of `rid`. Raises APIError 400 when it is not kept."""
        with self._lock:
            found = self._items.get(rid)
        if found is None:
            raise APIError(400, f"previous_response_id '{rid}' is not kept by this server (it keeps the last "
                                f"{self.capacity} stored responses, in memory)", param="previous_response_id",
                           code="previous_response_not_found")
        return list(found)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"{where}[{j}]", f"'{where}[{j}]': {kind} is not supported (this model reads text)")
        else:
            raise invalid(f"{where}[{j}]", f"'{where}[{j}]' must be an input_text or output_text part")
    return "".join(texts)


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """The chat messages of `input` (a string or a list of items). Raises APIError 400 naming the bad item."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise invalid("input", "'input' must be a string or a list of items")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"'{where}' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(where, f"'{where}.role' must be user, system, developer or assistant")
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                   "content": _content_text(item.get("content", ""), f"{where}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "".join(reasoning), []
            out.append(msg)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise invalid(where, f"'{where}' must have a name")
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = "".join(reasoning), []
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _content_text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []  # the full text, else its summary
            if not isinstance(parts, list):
                raise invalid(where, f"'{where}.content' and '{where}.summary' must be lists of text parts")
            reasoning += [str(p.get("text", "")) for p in parts if isinstance(p, dict)]
        else:
            raise invalid(where, f"'{where}': input items of type {kind!r} are not supported")
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid("tools", "'tools' must be a list")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise invalid(f"tools[{i}]", f"'tools[{i}]' must be a function tool ({{type: function, name, "
                                         "parameters}}); built-in tools are not supported")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "answer"),
                                                       "schema": fmt.get("schema")}}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise invalid("text.format", "'text.format.type' must be text, json_object or json_schema")


def to_chat_body(body: Mapping[str, Any], history: list[dict[str, Any]], strict: bool
                 ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(chat body, the conversation's messages, unknown fields ignored). `history`: the previous response's
    conversation. Raises APIError 400 naming the bad field."""
    unknown = sorted(k for k in body if k not in RESPONSES_FIELDS)
    if unknown and strict:
        raise invalid(unknown[0], f"unknown field '{unknown[0]}'")
    if body.get("background"):
        raise invalid("background", "'background' responses are not supported")
    if "input" not in body:
        raise invalid("input", "'input' is required")
    conversation = history + input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "'instructions' must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if not messages:
        raise invalid("input", "'input' must hold at least one item")
    out: dict[str, Any] = {"messages": messages}
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("stream", "stream"),
                     ("max_output_tokens", "max_tokens"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("cache_salt", "cache_salt")):  # Tandem's: the prefix-cache namespace, as on chat
        if body.get(src) is not None:
            out[dst] = body[src]
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None and (tools or choice == "none"):
        out["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return out, conversation, unknown
