"""OpenAI Responses request body -> the chat body `parse_chat` validates; and the bounded store of recent
responses that `previous_response_id` names.

Mapping: `instructions`, then every system / developer message item, in order -> the one system message Qwen's
template allows (agent_request.merge_system); `input` a string -> one user message; input items: messages (role
user / system / developer / assistant; content a string or input_text / output_text parts), function_call -> an
assistant tool call, function_call_output -> a tool message, reasoning -> the next assistant message's
reasoning_content (its content, else its summary, else its encrypted_content, which this server fills with the
plain text). tools[]: {type: function, name, parameters} -> chat tools; {type: namespace, name, tools} -> each
member function offered as "<namespace>.<name>" (calls come back with `name` and `namespace` apart); hosted tools
(web_search, file_search, code_interpreter, ...) are dropped and reported as ignored. tool_choice as in chat
({type: function, name} for a named one; {type: allowed_tools, mode, tools} narrows the tools). reasoning.effort
-> thinking off ("none") or on with agent_request.EFFORT_BUDGETS' budget; `chat_template_kwargs` (vLLM's) as on
chat, over the effort's. text.format json_schema / json_object -> response_format; max_output_tokens ->
max_tokens. Images and files are refused (400).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

from tandem.server.agent_request import effort_thinking, merge_system
from tandem.server.errors import APIError, invalid

RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                    "reasoning", "metadata", "user", "include", "truncation", "service_tier", "prompt_cache_key",
                    "safety_identifier", "background", "top_logprobs", "stream_options", "max_tool_calls",
                    "cache_salt", "chat_template_kwargs"}
HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
                "file_search", "code_interpreter", "computer_use_preview", "computer", "image_generation", "mcp",
                "local_shell", "shell", "apply_patch", "tool_search"}  # run by OpenAI's servers or unknown here
NAMESPACE_SEP = "."


class ResponseStore:
    """The last stored responses: id -> what `previous_response_id` needs (the conversation as chat messages, up to
    and including the output) and what `GET /v1/responses/{id}` returns (the response object), kept as compact JSON
    bytes. At most `capacity` responses and `max_bytes` bytes; the oldest is dropped first, and a response larger
    than `max_bytes` is not kept. Thread-safe.

    Args:
        capacity: the most responses kept (0: none).
        max_bytes: the most bytes kept, all responses together.
    """

    def __init__(self, capacity: int, max_bytes: int = 64 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict[str, Any]], response: dict[str, Any] | None = None) -> None:
        """Keep `messages` (and the response object) under `rid`, dropping the oldest past the bounds."""
        data = orjson.dumps({"messages": messages, "response": response})
        if self.capacity <= 0 or len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(rid, None)
            self.num_bytes += len(data) - (len(old) if old is not None else 0)
            self._items[rid] = data
            while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
                self.num_bytes -= len(self._items.popitem(last=False)[1])

    def __len__(self) -> int:
        return len(self._items)

    def _find(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            data = self._items.get(rid)
        return orjson.loads(data) if data is not None else None

    def get(self, rid: str) -> list[dict[str, Any]]:
        """The conversation of `rid`. Raises APIError 400 when it is not kept."""
        found = self._find(rid)
        if found is None:
            raise APIError(400, f"previous_response_id {rid[:80]!r} is not kept by this server (it keeps the last "
                                f"{self.capacity} stored responses, at most {self.max_bytes} bytes, in memory)",
                           param="previous_response_id", code="previous_response_not_found")
        return list(found["messages"])

    def response(self, rid: str) -> dict[str, Any]:
        """The response object of `rid`. Raises APIError 404 when it is not kept."""
        found = self._find(rid)
        if found is None or found["response"] is None:
            raise APIError(404, f"no stored response with id {rid[:80]!r} (responses with store false, and the "
                                "oldest past the store's bounds, are not kept)", code="not_found")
        return dict(found["response"])


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
            name = item["name"]
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = item["namespace"] + NAMESPACE_SEP + name
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments") or "{}"}}
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
            texts = [str(p.get("text", "")) for p in parts if isinstance(p, dict)]
            encrypted = item.get("encrypted_content")
            reasoning += texts or ([encrypted] if isinstance(encrypted, str) else [])
        else:
            raise invalid(where, f"'{where}': input items of type {kind!r} are not supported")
    return out


def _function(fn: dict[str, Any], name: str) -> dict[str, Any]:
    out = {k: fn[k] for k in ("description", "parameters") if fn.get(k) is not None}
    return {"type": "function", "function": {"name": name, **out}}


def _tools(raw: Any) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """(chat tools or None, the hosted tools dropped, as "tools[i]:type")."""
    if raw is None:
        return None, []
    if not isinstance(raw, list):
        raise invalid("tools", "'tools' must be a list")
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOLS:
            dropped.append(f"tools[{i}]:{kind}")
        elif kind == "namespace" and isinstance(tool, dict) and isinstance(tool.get("name"), str) \
                and isinstance(tool.get("tools"), list):
            for j, member in enumerate(tool["tools"]):
                if not isinstance(member, dict) or member.get("type") != "function" \
                        or not isinstance(member.get("name"), str):
                    raise invalid(f"tools[{i}].tools[{j}]", f"'tools[{i}].tools[{j}]' must be a function tool "
                                                            "({type: function, name, parameters})")
                out.append(_function(member, tool["name"] + NAMESPACE_SEP + member["name"]))
        elif kind == "function" and isinstance(tool, dict) and isinstance(tool.get("name"), str):
            out.append(_function(tool, tool["name"]))
        else:
            raise invalid(f"tools[{i}]", f"'tools[{i}]' must be a function tool ({{type: function, name, "
                                         f"parameters}}) or a namespace of them; {kind!r} tools are not supported")
    return out, dropped


def namespace_members(raw: Any) -> dict[str, tuple[str, str]]:
    """The request's namespaced functions: "<namespace>.<name>" -> (namespace, name)."""
    out: dict[str, tuple[str, str]] = {}
    for tool in raw if isinstance(raw, list) else []:
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for member in tool["tools"]:
                if isinstance(member, dict) and isinstance(member.get("name"), str):
                    out[str(tool["name"]) + NAMESPACE_SEP + member["name"]] = (str(tool["name"]), member["name"])
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, list[dict[str, Any]] | None]:
    """(chat tool_choice, the tools it leaves) of a Responses tool_choice."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice.get("name")}}, tools
    if kind == "allowed_tools" and isinstance(choice, dict) and choice.get("mode") in ("auto", "required"):
        names = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
        kept = [t for t in tools or [] if t["function"]["name"] in names]
        return choice["mode"], kept
    raise invalid("tool_choice", "'tool_choice' must be none, auto, required, {type: function, name} or "
                                 "{type: allowed_tools, mode, tools}")


def _thinking(body: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """(chat_template_kwargs, thinking budget) of `reasoning.effort` and `chat_template_kwargs`."""
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise invalid("reasoning", "'reasoning' must be an object")
    kwargs, budget = effort_thinking((reasoning or {}).get("effort"), "reasoning.effort")
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    return {**kwargs, **(extra or {})}, budget


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


def to_chat_body(body: Mapping[str, Any], history: list[dict[str, Any]], strict: bool,
                 default_budget: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(chat body, the conversation's messages, unknown fields ignored and hosted tools dropped). `history`: the
    previous response's conversation; `default_budget`: the thinking budget when `reasoning.effort` is absent (the
    route passes medium's, OpenAI's default effort, unless the server sets `--reasoning-budget`). Raises APIError 400
    naming the bad field."""
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
    messages = merge_system(([{"role": "system", "content": instructions}] if instructions else []) + conversation)
    if not messages:
        raise invalid("input", "'input' must hold at least one item")
    kwargs, budget = _thinking(body)
    effort = body["reasoning"].get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is None:
        budget = default_budget
    out: dict[str, Any] = {"messages": messages, "chat_template_kwargs": kwargs}
    if budget is not None:
        out["thinking_token_budget"] = budget
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("stream", "stream"),
                     ("max_output_tokens", "max_tokens"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("cache_salt", "cache_salt")):  # Tandem's: the prefix-cache namespace, as on chat
        if body.get(src) is not None:
            out[dst] = body[src]
    tools, dropped = _tools(body.get("tools"))
    choice, tools = _tool_choice(body.get("tool_choice"), tools)
    if tools:
        out["tools"] = tools
    if choice is not None and (tools or choice == "none"):
        out["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return out, conversation, unknown + dropped
