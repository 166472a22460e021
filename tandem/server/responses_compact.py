"""Compaction: a conversation replaced by a summary the model writes itself, for `POST /v1/responses/compact` and for
a `{type: compaction_trigger}` item ending a `/v1/responses` input (Codex's newer form of the same request).

The model is asked, with thinking off, to write the summary: the conversation as the request gives it (instructions,
tools and every item, so its prompt is the conversation's own prefix and the prefix cache serves it), then one user
turn holding COMPACTION_PROMPT. The summary goes back as one `compaction` item whose `encrypted_content` is the
summary in plain text (this server keeps no state for it); the compact endpoint's output also keeps the
conversation's user messages, verbatim, before it (as OpenAI's does). Sent as input again, the compaction item
becomes a user turn holding responses_request.COMPACTION_HEADER and the summary, so the compacted conversation is a
new, shorter prefix, cached like any other. References: the Responses API's compact endpoint
(platform.openai.com/docs/api-reference/responses/compact) and Open Responses' CompactResource.
"""

from __future__ import annotations

from typing import Any

from tandem.server.responses_events import new_id
from tandem.server.responses_request import COMPACTION_MARK, summary_message

COMPACTION_PROMPT = (
    "Compact the conversation above into a summary that lets it go on without the earlier messages. Write what "
    "the user asked for and still wants, the decisions made and why, what was done (files, commands and their "
    "results), what remains to do, and every name, number, path or piece of code the rest of the work needs. "
    "Write only the summary.")
COMPACT_MAX_TOKENS = 2048  # the summary's budget unless the request's max_output_tokens is smaller
COMPACT_CONTEXT_SHARE = 4  # and at most 1/4 of the context: a summary must leave the conversation room to go on
# the compact endpoint's fields (Open Responses' CompactResponseMethodPublicBody) and Tandem's max_output_tokens
COMPACT_FIELDS = {"model", "input", "previous_response_id", "instructions", "prompt_cache_key", "max_output_tokens"}


def compact_budget(max_context: int) -> int:
    """The summary's token budget on a server of `max_context` tokens: COMPACT_MAX_TOKENS, or 1/COMPACT_CONTEXT_SHARE
    of the context where that is smaller (at least 1), so the compacted conversation is well short of the context."""
    return max(1, min(COMPACT_MAX_TOKENS, max_context // COMPACT_CONTEXT_SHARE))


def compaction_chat_body(chat: dict[str, Any], max_context: int) -> dict[str, Any]:
    """The chat body that asks for the summary of `chat`'s conversation: its messages, then COMPACTION_PROMPT as a
    user turn; thinking off; tools kept in the prompt (the same prefix as the conversation's requests) but never
    forced; no response format; at most ``compact_budget(max_context)`` tokens (or the request's max_output_tokens
    if smaller)."""
    out = {k: v for k, v in chat.items() if k not in ("response_format", "thinking_token_budget", "tool_choice")}
    out["messages"] = [*chat["messages"], {"role": "user", "content": COMPACTION_PROMPT}]
    out["chat_template_kwargs"] = {**(chat.get("chat_template_kwargs") or {}), "enable_thinking": False}
    given = chat.get("max_tokens")
    budget = compact_budget(max_context)
    if given is None:
        out["max_tokens"] = budget
    elif isinstance(given, int) and not isinstance(given, bool):  # anything else: parse_chat's 400 names it
        out["max_tokens"] = min(given, budget)
    if chat.get("tools"):
        out["tool_choice"] = "auto"
    return out


def _user_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation's own user messages (not an earlier compaction's summary: the new summary covers it)."""
    return [m for m in conversation if m.get("role") == "user" and not m.get(COMPACTION_MARK)]


def compaction_item(summary: str) -> dict[str, Any]:
    """The `compaction` output item holding `summary`."""
    return {"type": "compaction", "id": new_id("cmp"), "encrypted_content": summary}


def compacted_output(conversation: list[dict[str, Any]], summary: str) -> list[dict[str, Any]]:
    """The compact endpoint's output items: the conversation's user messages (verbatim), then the compaction item."""
    users = [{"type": "message", "id": new_id("msg"), "status": "completed", "role": "user",
              "content": _input_parts(m.get("content"))} for m in _user_messages(conversation)]
    return [*users, compaction_item(summary)]


def _input_parts(content: Any) -> list[dict[str, Any]]:
    """A chat user message's content as Responses input parts: input_text, and input_image for its images."""
    if not isinstance(content, list):
        return [{"type": "input_text", "text": str(content or "")}]
    out: list[dict[str, Any]] = []
    for part in content:
        url = part.get("image_url") if isinstance(part, dict) else None
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str):
            out.append({"type": "input_image", "image_url": url, "detail": "auto"})
        elif isinstance(part, dict):
            out.append({"type": "input_text", "text": str(part.get("text") or "")})
    return out


def compacted_conversation(conversation: list[dict[str, Any]], summary: str, keep_users: bool
                           ) -> list[dict[str, Any]]:
    """The conversation a later `previous_response_id` continues after a compaction: the user messages (when the
    output kept them) and the summary's user turn."""
    return [*(_user_messages(conversation) if keep_users else []), summary_message(summary)]
