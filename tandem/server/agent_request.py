"""What the agent APIs (Anthropic Messages, OpenAI Responses) share when they become a chat body: one system turn,
and thinking effort as the template's thinking switch and budget.

Qwen's chat templates allow one system message, first ("A system message is only allowed first"); agents send
several (Claude Code a `system` message inside `messages`, Codex two `developer` items). `merge_system` folds every
system message into the first one, in order, joined by a blank line, so nothing is lost and the template renders.

Effort levels (Anthropic's `output_config.effort`: low / medium / high / xhigh / max; OpenAI's `reasoning.effort`:
none / minimal / low / medium / high / xhigh) map onto the thinking budget in tokens (`EFFORT_BUDGETS`); "none"
turns thinking off, "max" leaves it unbounded (the context bounds it).
"""

from __future__ import annotations

from typing import Any

from tandem.server.errors import invalid

# thinking tokens allowed per effort level; None: unbounded
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 256, "low": 1024, "medium": 4096, "high": 8192,
                                         "xhigh": 16384, "max": None}


def merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every system message folded into one leading system message (texts in order, joined by a
    blank line; empty ones dropped). Other messages keep their order. Content must be strings here."""
    texts = [str(m.get("content") or "") for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    joined = "\n\n".join(t for t in texts if t)
    return ([{"role": "system", "content": joined}] if joined else []) + rest


def effort_thinking(effort: Any, param: str) -> tuple[dict[str, Any], int | None]:
    """(chat_template_kwargs, thinking budget) for an effort level; `effort` None: ({}, None), the server's
    defaults.

    Raises: APIError 400 naming `param` for an unknown level."""
    if effort is None:
        return {}, None
    if effort == "none":
        return {"enable_thinking": False}, None
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:
        raise invalid(param, f"'{param}' must be one of none, {', '.join(EFFORT_BUDGETS)}")
    return {"enable_thinking": True}, EFFORT_BUDGETS[effort]
