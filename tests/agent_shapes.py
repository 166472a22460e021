"""The request shapes of the two coding agents' first requests, with placeholder text: Claude Code 2.1's
`POST /v1/messages?beta=true` and Codex CLI 0.171's `POST /v1/responses` (fields, block types, item roles, tool
kinds and their order as the agents send them; the prompts' texts are not copied)."""

from __future__ import annotations

from typing import Any

CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01", "x-app": "cli", "anthropic-dangerous-direct-browser-access": "true",
    "anthropic-beta": "claude-code-20250219,context-1m-2025-08-07,interleaved-thinking-2025-05-14,"
                      "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
                      "mid-conversation-system-2026-04-07,effort-2025-11-24"}


def _tool(name: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"name": name, "description": f"{name}: a tool of the agent.", "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": props,
        "required": required, "additionalProperties": False}}


def claude_code_body(max_tokens: int = 64000) -> dict[str, Any]:
    """Claude Code's first request for `claude -p "say hi"`."""
    tools = [_tool("Bash", {"command": {"type": "string"}, "timeout": {"type": "number"},
                            "run_in_background": {"type": "boolean"}}, ["command"]),
             _tool("Read", {"file_path": {"type": "string"}, "offset": {"type": "integer"},
                            "limit": {"type": "integer"}}, ["file_path"]),
             _tool("Edit", {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                            "new_string": {"type": "string"}, "replace_all": {"type": "boolean", "default": False}},
                   ["file_path", "old_string", "new_string"]),
             _tool("TaskCreate", {"subject": {"type": "string"}, "metadata": {
                 "type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}}}, ["subject"])]
    return {
        "model": "claude-opus-4-8",
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-06.\n</system-reminder>\n\n"},
                {"type": "text", "text": "say hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types for the Agent tool:\n- Explore: searches."}],
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
                   {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "\nYou are an interactive agent.", "cache_control": {
                       "type": "ephemeral", "ttl": "1h"}}],
        "tools": tools,
        "metadata": {"user_id": '{"device_id":"0","account_uuid":"","session_id":"s"}'},
        "max_tokens": max_tokens,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def codex_body() -> dict[str, Any]:
    """Codex CLI's first request for `codex exec "say hi"` (a custom provider, wire_api "responses")."""
    def fn(name: str, props: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function", "name": name, "description": f"{name}: a tool of the agent.", "strict": False,
                "parameters": {"type": "object", "properties": props, "required": list(props)[:1],
                               "additionalProperties": False}}

    def message(role: str, text: str) -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{role}_{len(text)}", "role": role,
                "content": [{"type": "input_text", "text": text}]}

    return {
        "model": "default", "stream": True,
        "input": [message("developer", "You are a coding agent running in the Codex CLI."),
                  message("developer", "<skills_instructions>\n## Skills\n</skills_instructions>"),
                  message("user", "<environment_context>\n  <cwd>/tmp/w</cwd>\n</environment_context>"),
                  message("user", "say hi")],
        "tools": [fn("exec_command", {"cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}}),
                  fn("write_stdin", {"session_id": {"type": "number"}, "chars": {"type": "string"}}),
                  fn("view_image", {"path": {"type": "string"}}),
                  {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
                   "tools": [fn("close_agent", {"target": {"type": "string"}}),
                             fn("spawn_agent", {"message": {"type": "string"}})]},
                  fn("get_goal", {}),
                  {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0",
        "client_metadata": {"session_id": "0"},
    }
