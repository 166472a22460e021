"""Anthropic Messages request body -> the OpenAI chat body `parse_chat` validates (one pipeline for both APIs).

Mapping: `system` (string or text blocks) and every `role: "system"` message inside `messages` -> one system
message, in order (agent_request.merge_system: Qwen's template takes one, first); user blocks: text -> content,
image -> an `image_url` part in the content, in block order (source `base64` -> a data URI of its media_type;
`url` -> the URL, fetched by the server only with `--allow-image-urls`, else a 400; `file` -> a 400: no Files API
here), tool_result -> a `tool` message (before the user's text, in block order; its content a string or text /
image / search_result / text-document / tool_reference blocks), plain-text documents and search results -> text;
assistant blocks: text -> content, thinking -> reasoning_content, tool_use -> tool_calls. Blank text blocks are
kept (as empty text). tools[].input_schema -> function parameters; tool_choice auto / any / tool / none -> "auto" /
"required" / named / "none" (`disable_parallel_tool_use` -> parallel_tool_calls false); stop_sequences -> stop;
thinking {type: "enabled", budget_tokens} -> the template's thinking on and thinking_token_budget; {type:
"adaptive"} (and "between_tools") -> thinking on with the budget of `output_config.effort` (high when absent;
agent_request.EFFORT_BUDGETS), unless the server's default template kwargs set `enable_thinking`; thinking absent
or disabled -> enable_thinking false (unless the server's defaults set it). `output_config.format` (json_schema) ->
response_format. `cache_control` (top level and on blocks) is accepted: the prefix cache keeps every prompt.
Images outside user messages and tool results, binary documents, server tools, `container` and `mcp_servers` are
refused (400 naming the field); other unknown fields (`context_management`, ...) are ignored and reported.
Reference: the Messages API's content blocks (docs.anthropic.com: "Vision", "Messages" image / tool_result blocks).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tandem.image_fetch import URLS_OFF, is_image_url
from tandem.server.agent_request import effort_thinking, merge_system
from tandem.server.errors import invalid

MESSAGES_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
                   "top_k", "metadata", "tools", "tool_choice", "thinking", "service_tier", "cache_salt",
                   "cache_control", "output_config", "inference_geo", "speed", "user_profile_id", "workspace_id",
                   "container", "mcp_servers"}
_REFUSED_FIELDS = ("container", "mcp_servers")  # an Anthropic-hosted sandbox / MCP servers: no such thing here
_REFUSED_BLOCKS = {"container_upload", "server_tool_use", "web_search_tool_result",
                   "web_fetch_tool_result", "code_execution_tool_result", "bash_code_execution_tool_result",
                   "text_editor_code_execution_tool_result", "tool_search_tool_result", "browser_state"}
_MEDIA_TYPE = re.compile(r"image/[A-Za-z0-9.+-]{1,40}")  # what may sit in the data URI's head
Piece = str | dict[str, Any]  # a user or tool_result block as text, or a chat image_url part


def _document_text(block: dict[str, Any], where: str) -> str:
    """A document block's text: a plain-text source or a content source of text blocks (else 400)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source, dict) and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content" and isinstance(source, dict):
        text = _text_of(source.get("content"), f"{where}.source.content")
    else:
        raise invalid(where, f"'{where}': {kind} documents are not supported (this model reads text; send a "
                             "plain-text document)")
    title = block.get("title")
    return f"{title}\n{text}" if isinstance(title, str) and title else text


def _block_text(block: Any, where: str) -> str:
    """The text of one readable block (text, search_result, text document, tool_reference). Raises 400 naming
    `where` for anything else."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in _REFUSED_BLOCKS:
        raise invalid(where, f"'{where}': {kind} blocks are not supported (this model reads text)")
    if kind == "image":
        raise invalid(where, f"'{where}': image blocks are read in user messages and tool results only")
    if kind == "text" and isinstance(block, dict) and isinstance(block.get("text", ""), str):
        return str(block.get("text", ""))  # a blank text block is empty text
    if kind == "search_result" and isinstance(block, dict):
        body = _text_of(block.get("content", []), f"{where}.content")
        return "\n".join(str(block.get(k)) for k in ("title", "source") if block.get(k)) + "\n" + body
    if kind == "document" and isinstance(block, dict):
        return _document_text(block, where)
    if kind == "tool_reference" and isinstance(block, dict) and isinstance(block.get("tool_name"), str):
        return f"[tool: {block['tool_name']}]"
    raise invalid(where, f"'{where}' must be a text block")


def _text_of(content: Any, where: str) -> str:
    """The text of a string or of a list of readable blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of content blocks")
    return "".join(_block_text(block, f"{where}[{j}]") for j, block in enumerate(content))


def image_part(block: Mapping[str, Any], where: str, allow_urls: bool) -> dict[str, Any]:
    """An Anthropic image block ({type: image, source}) as a chat ``image_url`` part (tandem/multimodal.py reads it).

    Sources: {type: base64, media_type: image/..., data} -> a ``data:`` URI; {type: url, url} -> the URL, for the
    server to fetch (``allow_urls``: ``--allow-image-urls``). The image itself is checked later, where the prompt is
    built. Raises APIError 400 naming the block or its field: a file source (the Files API), a URL without
    ``allow_urls``, a missing or malformed source.
    """
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not _MEDIA_TYPE.fullmatch(media):
            raise invalid(f"{where}.source.media_type", f"'{where}.source.media_type' must be an image type "
                                                        "(image/jpeg, image/png, image/gif or image/webp)")
        if not isinstance(data, str) or not data:
            raise invalid(f"{where}.source.data", f"'{where}.source.data' must be the image's base64 text")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source, dict):
        url = source.get("url")
        if not is_image_url(url):
            raise invalid(f"{where}.source.url", f"'{where}.source.url' must be an http(s) URL")
        if not allow_urls:
            raise invalid(where, f"'{where}': {URLS_OFF}")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "file":
        raise invalid(where, f"'{where}': file sources (the Files API) are not supported; send the image as "
                             "base64 data")
    raise invalid(where, f"'{where}' must be an image block with a source of type base64 or url")


def _piece(block: Any, where: str, allow_urls: bool) -> Piece:
    """A user or tool_result block: an image part for an image block, else its text (``_block_text``)."""
    if isinstance(block, dict) and block.get("type") == "image":
        return image_part(block, where, allow_urls)
    return _block_text(block, where)


def _joined(pieces: list[Piece]) -> str | list[dict[str, Any]]:
    """Text alone as one string; with images, a chat content list (adjacent texts in one text part)."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(str(p) for p in pieces)
    parts: list[dict[str, Any]] = []
    for p in pieces:
        if not isinstance(p, str):
            parts.append(p)
        elif parts and parts[-1].get("type") == "text":
            parts[-1]["text"] += p
        else:
            parts.append({"type": "text", "text": p})
    return parts


def _result_content(block: dict[str, Any], where: str, allow_urls: bool) -> str | list[dict[str, Any]]:
    """A tool_result block's content: a string, or its blocks (text, images, ...) joined; "error: " first when
    ``is_error``."""
    result = block.get("content", "")
    pieces: list[Piece] = ["error: "] if block.get("is_error") else []
    if isinstance(result, str):
        pieces.append(result)
    elif isinstance(result, list):
        pieces += [_piece(b, f"{where}.content[{k}]", allow_urls) for k, b in enumerate(result)]
    elif result is not None:
        raise invalid(f"{where}.content", f"'{where}.content' must be a string or a list of content blocks")
    return _joined(pieces)


def _user(i: int, content: Any, allow_urls: bool = False) -> list[dict[str, Any]]:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    pieces: list[Piece] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _result_content(block, f"{where}[{j}]", allow_urls)})
        else:
            pieces.append(_piece(block, f"{where}[{j}]", allow_urls))
    if pieces:
        out.append({"role": "user", "content": _joined(pieces)})
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
            texts.append(_block_text(block, f"{where}[{j}]"))
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


def _thinking(raw: Any, output_config: Any, defaults: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """(chat_template_kwargs, thinking budget) of `thinking` and `output_config.effort`."""
    if output_config is not None and not isinstance(output_config, dict):
        raise invalid("output_config", "'output_config' must be an object")
    effort = (output_config or {}).get("effort")
    kind = raw.get("type") if isinstance(raw, dict) else None
    if raw is None or kind == "disabled":
        return ({} if "enable_thinking" in defaults else {"enable_thinking": False}), None
    if kind in ("adaptive", "between_tools"):  # the model decides: here the server's default, else the effort's
        kwargs, budget = effort_thinking("high" if effort is None else effort, "output_config.effort")
        return ({}, None) if "enable_thinking" in defaults else (kwargs, budget)
    if kind != "enabled":
        raise invalid("thinking", "'thinking' must be {type: enabled, budget_tokens}, {type: adaptive} or "
                                  "{type: disabled}")
    budget = raw.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise invalid("thinking.budget_tokens", "'thinking.budget_tokens' must be a non-negative integer")
    return {"enable_thinking": True}, budget


def _output_format(output_config: Any) -> dict[str, Any] | None:
    """`output_config.format` ({type: json_schema, schema}) as a chat response_format, or None."""
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid("output_config.format", "'output_config.format' must be {type: json_schema, schema}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _messages(body: Mapping[str, Any], allow_urls: bool) -> list[dict[str, Any]]:
    """The chat messages: the system prompt and every system message first (in order), then the turns."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "'messages' must be a non-empty list")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system") or "content" not in m:
            raise invalid(f"messages[{i}]", f"'messages[{i}]' must have a role (user, assistant or system) and "
                                            "content")
        if role == "system":
            messages.append({"role": "system", "content": _text_of(m["content"], f"messages[{i}].content")})
        else:
            messages += _user(i, m["content"], allow_urls) if role == "user" else [_assistant(i, m["content"])]
    return merge_system(messages)


def to_chat_body(body: Mapping[str, Any], defaults: Mapping[str, Any], strict: bool,
                 count_only: bool = False, allow_image_urls: bool = False) -> tuple[dict[str, Any], list[str]]:
    """(the chat body, the unknown fields ignored). Raises APIError 400 naming the bad field (an unknown one under
    `strict`); `count_only` (count_tokens) needs no max_tokens; `allow_image_urls`: image blocks with a url source
    are kept for the server to fetch (``--allow-image-urls``), else refused."""
    unknown = sorted(k for k in body if k not in MESSAGES_FIELDS)
    if unknown and strict:
        raise invalid(unknown[0], f"unknown field '{unknown[0]}'")
    for name in _REFUSED_FIELDS:
        if body.get(name):
            raise invalid(name, f"'{name}' is not supported by this server")
    messages = _messages(body, allow_image_urls)
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count_only:
        raise invalid("max_tokens", "'max_tokens' is required")
    kwargs, budget = _thinking(body.get("thinking"), body.get("output_config"), defaults)
    choice, parallel = _tool_choice(body.get("tool_choice"))
    out: dict[str, Any] = {"messages": messages, "chat_template_kwargs": kwargs}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                     ("stop_sequences", "stop"), ("stream", "stream"),
                     ("cache_salt", "cache_salt")):  # Tandem's: the prefix-cache namespace, as on chat
        if body.get(src) is not None:
            out[dst] = body[src]
    # any model name is accepted here; the reply names the model asked for
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
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        out["response_format"] = fmt
    if budget is not None:
        out["thinking_token_budget"] = budget
    return out, unknown
