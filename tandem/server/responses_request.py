"""OpenAI Responses request body -> the chat body `parse_chat` validates (the store of recent responses that
`previous_response_id` names is responses_store.py).

Mapping: `instructions`, then every system / developer message item, in order -> the one system message Qwen's
template allows (agent_request.merge_system); `input` a string -> one user message; input items: messages (role
user / system / developer / assistant; content a string or input_text / output_text parts; a user message's
input_image parts -> chat `image_url` parts in order: `image_url` a data URI, or an http(s) URL fetched by the
server only with `--allow-image-urls`; `file_id` refused; `detail` accepted and not read, the model sees the image
at its processor's own resolution), function_call -> an assistant tool call, function_call_output -> a tool message
(its output a string or input_text / input_image parts; its call_id must be an earlier function_call's, as OpenAI
requires), compaction (written by /v1/responses/compact or a compaction_trigger: its encrypted_content is
the summary in plain text) -> a user message holding the summary, reasoning -> the next assistant message's
reasoning_content (its content, else its summary, else its encrypted_content, which this server fills with the
plain text). tools[]: {type: function, name, parameters} -> chat tools; {type: namespace, name, tools} -> each
member function offered as "<namespace>.<name>" (calls come back with `name` and `namespace` apart); hosted tools
(web_search, file_search, code_interpreter, ...) are dropped and reported as ignored. tool_choice as in chat
({type: function, name} for a named one; {type: allowed_tools, mode, tools} narrows the tools). reasoning.effort
-> thinking off ("none") or on with agent_request.EFFORT_BUDGETS' budget; `chat_template_kwargs` (vLLM's) as on
chat, over the effort's. text.format json_schema / json_object -> response_format; max_output_tokens ->
max_tokens; temperature, top_p, presence_penalty and frequency_penalty as on chat. Files and audio are refused
(400). Reference: the Responses API's input items (platform.openai.com/docs/api-reference/responses/create).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.image_fetch import URLS_OFF, is_image_url
from tandem.server.agent_request import effort_thinking, merge_system
from tandem.server.errors import invalid
from tandem.server.responses_store import ResponseStore

__all__ = ["ResponseStore", "input_messages", "namespace_members", "split_trigger", "to_chat_body"]

RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                    "reasoning", "metadata", "user", "include", "truncation", "service_tier", "prompt_cache_key",
                    "safety_identifier", "background", "top_logprobs", "stream_options", "max_tool_calls",
                    "cache_salt", "chat_template_kwargs", "presence_penalty", "frequency_penalty"}
HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
                "file_search", "code_interpreter", "computer_use_preview", "computer", "image_generation", "mcp",
                "local_shell", "shell", "apply_patch", "tool_search"}  # run by OpenAI's servers or unknown here
NAMESPACE_SEP = "."


def input_image(part: Mapping[str, Any], where: str, allow_urls: bool) -> dict[str, Any]:
    """A Responses ``input_image`` part ({image_url, detail} or {file_id}) as a chat ``image_url`` part.

    ``image_url``: a data URI, or an http(s) URL for the server to fetch (``allow_urls``: ``--allow-image-urls``).
    ``detail`` (low / high / auto) is accepted and not read. The image itself is checked where the prompt is built.
    Raises APIError 400 naming the part: a file_id (the Files API), a URL without ``allow_urls``, no image_url.
    """
    url = part.get("image_url")
    if part.get("file_id") is not None and url is None:
        raise invalid(where, f"'{where}': input_image with a file_id (the Files API) is not supported; send "
                             "image_url as a data URI")
    if not isinstance(url, str) or not url:
        raise invalid(where, f"'{where}' must be an input_image part with an image_url (a data URI)")
    if is_image_url(url) and not allow_urls:
        raise invalid(where, f"'{where}': {URLS_OFF}")
    if not is_image_url(url) and not url.startswith("data:"):
        raise invalid(where, f"'{where}.image_url' must be a data URI (data:image/png;base64,...) or an http(s) URL")
    return {"type": "image_url", "image_url": {"url": url}}


def _content(content: Any, where: str, images: bool = False, allow_urls: bool = False
             ) -> str | list[dict[str, Any]]:
    """A message's or output's content as chat content: its text, or (``images``: where input_image parts may
    stand) a list of text and image_url parts when it holds an image. Raises APIError 400 naming the bad part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images and isinstance(part, dict):
            parts.append(input_image(part, f"{where}[{j}]", allow_urls))
        elif kind in ("input_image", "input_file", "input_audio"):
            why = "is read in user messages and function_call_output only" if kind == "input_image" else \
                "is not supported (this model reads text and images)"
            raise invalid(f"{where}[{j}]", f"'{where}[{j}]': {kind} {why}")
        else:
            raise invalid(f"{where}[{j}]", f"'{where}[{j}]' must be an input_text or output_text part")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


COMPACTION_HEADER = "A summary of the earlier conversation, written when it was compacted:\n\n"
COMPACTION_MARK = "compaction"  # the key marking the chat message a compaction item became (a template ignores it)


def summary_message(summary: str) -> dict[str, Any]:
    """The chat message a `compaction` item stands for: a user turn holding the summary after COMPACTION_HEADER."""
    return {"role": "user", "content": COMPACTION_HEADER + summary, COMPACTION_MARK: True}


def _calls(messages: list[dict[str, Any]]) -> set[str]:
    return {str(c.get("id")) for m in messages for c in m.get("tool_calls") or [] if isinstance(c, dict)}


def input_messages(raw: Any, history: list[dict[str, Any]] | None = None, allow_image_urls: bool = False
                   ) -> list[dict[str, Any]]:
    """The chat messages of `input` (a string or a list of items) after `history` (the previous response's
    conversation: its tool calls are the ones a function_call_output may answer). `allow_image_urls`: input_image
    URLs are kept for the server to fetch, else refused. Raises APIError 400 naming the bad item (a
    function_call_output whose call_id no earlier function_call has, an image where none may stand)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise invalid("input", "'input' must be a string or a list of items")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    known = _calls(history or [])
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
                                   "content": _content(item.get("content", ""), f"{where}.content",
                                                       role == "user", allow_image_urls)}
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
            if str(item.get("call_id", "")) not in known | _calls(out):
                raise invalid(where, f"'{where}': no function_call with call_id "
                                     f"{str(item.get('call_id', ''))[:80]!r} comes before this function_call_output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _content(output, f"{where}.output", True, allow_image_urls)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []  # the full text, else its summary
            if not isinstance(parts, list):
                raise invalid(where, f"'{where}.content' and '{where}.summary' must be lists of text parts")
            texts = [str(p.get("text", "")) for p in parts if isinstance(p, dict)]
            encrypted = item.get("encrypted_content")
            reasoning += texts or ([encrypted] if isinstance(encrypted, str) else [])
        elif kind == "compaction":  # written by this server (responses_compact.py): the summary in plain text
            if not isinstance(item.get("encrypted_content"), str):
                raise invalid(where, f"'{where}.encrypted_content' must be a string")
            out.append(summary_message(item["encrypted_content"]))
        elif kind == "compaction_trigger":
            raise invalid(where, f"'{where}': a compaction_trigger item must be the last input item")
        else:
            raise invalid(where, f"'{where}': input items of type {kind!r} are not supported")
    return out


def split_trigger(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the body without a final `{type: compaction_trigger}` input item, whether it had one): a request that asks
    for its conversation to be compacted (responses_compact.py) instead of answered."""
    items = body.get("input")
    if isinstance(items, list) and items and isinstance(items[-1], dict) \
            and items[-1].get("type") == "compaction_trigger":
        return {**body, "input": items[:-1]}, True
    return dict(body), False


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
                 default_budget: int | None = None, allow_image_urls: bool = False
                 ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(chat body, the conversation's messages, unknown fields ignored and hosted tools dropped). `history`: the
    previous response's conversation; `default_budget`: the thinking budget when `reasoning.effort` is absent (the
    route passes medium's, OpenAI's default effort, unless the server sets `--reasoning-budget`); `allow_image_urls`:
    input_image URLs are kept for the server to fetch (``--allow-image-urls``), else refused. Raises APIError 400
    naming the bad field."""
    unknown = sorted(k for k in body if k not in RESPONSES_FIELDS)
    if unknown and strict:
        raise invalid(unknown[0], f"unknown field '{unknown[0]}'")
    if body.get("background"):
        raise invalid("background", "'background' responses are not supported")
    if "input" not in body:
        raise invalid("input", "'input' is required")
    conversation = history + input_messages(body["input"], history, allow_image_urls)
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
                     ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
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
