"""Anthropic Messages request body -> the OpenAI chat body `parse_chat` validates (one pipeline for both APIs).

Mapping: `system` (string or text blocks) -> a system message; user blocks: text -> content, tool_result -> a
`tool` message (before the user's text, in block order); assistant blocks: text -> content, thinking ->
reasoning_content, tool_use -> tool_calls. tools[].input_schema -> function parameters; tool_choice auto / any /
tool / none -> "auto" / "required" / named / "none" (`disable_parallel_tool_use` -> parallel_tool_calls false);
stop_sequences -> stop; thinking {type: "enabled", budget_tokens} -> the template's thinking on and
thinking_token_budget; thinking absent or disabled -> enable_thinking false (unless the server's default template
kwargs set it). Images and documents are refused (400).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.server.errors import invalid

MESSAGES_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
                   "top_k", "metadata", "tools", "tool_choice", "thinking", "service_tier", "cache_salt"}
_REFUSED_BLOCKS = {"image", "document", "search_result", "container_upload"}


def _text_of(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of content blocks")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _REFUSED_BLOCKS:
            raise invalid(f"{where}[{j}]", f"'{where}[{j}]': {kind} blocks are not supported (this model reads text)")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{where}[{j}]", f"'{where}[{j}]' must be a text block")
        texts.append(block["text"])
    return "".join(texts)


def _user(i: int, content: Any) -> list[dict[str, Any]]:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            result = block.get("content", "")
            text = _text_of(result, f"{where}[{j}].content") if result is not None else ""
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": ("error: " + text) if block.get("is_error") else text})
        else:
            texts.append(_text_of([block], where))
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(i: int, content: Any) -> dict[str, Any]:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of content blocks")
    texts, thinking, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise invalid(f"{where}[{j}]", f"'{where}[{j}]' must be a tool_use block with a name and an input")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        else:
            texts.append(_text_of([block], where))
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid("tools", "'tools' must be a list")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise invalid(f"tools[{i}]", f"'tools[{i}]' must be an object with a name and an input_schema")
        if tool.get("type") not in (None, "custom"):
            raise invalid(f"tools[{i}]", f"'tools[{i}]': server tools ({tool.get('type')}) are not supported")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> tuple[Any, bool]:
    if raw is None:
        return None, True
    kind = raw.get("type") if isinstance(raw, dict) else None
    parallel = not bool(raw.get("disable_parallel_tool_use", False)) if isinstance(raw, dict) else True
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}, False
    raise invalid("tool_choice", "'tool_choice' must be {type: auto | any | none} or {type: tool, name}")


def _thinking(raw: Any, defaults: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """(chat_template_kwargs, thinking budget)."""
    if raw is None or (isinstance(raw, dict) and raw.get("type") == "disabled"):
        return ({} if "enable_thinking" in defaults else {"enable_thinking": False}), None
    if not isinstance(raw, dict) or raw.get("type") != "enabled":
        raise invalid("thinking", "'thinking' must be {type: enabled, budget_tokens} or {type: disabled}")
    budget = raw.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise invalid("thinking.budget_tokens", "'thinking.budget_tokens' must be a non-negative integer")
    return {"enable_thinking": True}, budget


def to_chat_body(body: Mapping[str, Any], defaults: Mapping[str, Any], strict: bool,
                 count_only: bool = False) -> tuple[dict[str, Any], list[str]]:
    """(the chat body, the unknown fields ignored). Raises APIError 400 naming the bad field (an unknown one under
    `strict`); `count_only` (count_tokens) needs no max_tokens."""
    unknown = sorted(k for k in body if k not in MESSAGES_FIELDS)
    if unknown and strict:
        raise invalid(unknown[0], f"unknown field '{unknown[0]}'")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "'messages' must be a non-empty list")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant") or "content" not in m:
            raise invalid(f"messages[{i}]", f"'messages[{i}]' must have a role (user or assistant) and content")
        messages += _user(i, m["content"]) if role == "user" else [_assistant(i, m["content"])]
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count_only:
        raise invalid("max_tokens", "'max_tokens' is required")
    kwargs, budget = _thinking(body.get("thinking"), defaults)
    choice, parallel = _tool_choice(body.get("tool_choice"))
    out: dict[str, Any] = {"messages": messages, "chat_template_kwargs": kwargs}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                     ("stop_sequences", "stop"), ("stream", "stream"), ("model", "model"),
                     ("cache_salt", "cache_salt")):  # Tandem's: the prefix-cache namespace, as on chat
        if body.get(src) is not None:
            out[dst] = body[src]
    out.pop("model", None)  # any model name is accepted here; the reply names the served model
    if max_tokens is not None and not count_only:
        out["max_tokens"] = max_tokens
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        if choice is not None:
            out["tool_choice"] = choice
        out["parallel_tool_calls"] = parallel
    elif choice not in (None, "auto", "none"):
        raise invalid("tool_choice", "'tool_choice' needs 'tools'")
    if budget is not None:
        out["thinking_token_budget"] = budget
    return out, unknown
