"""The agent APIs' request translations without a server: Claude Code's and Codex's first-request shapes become
valid chat requests (one system turn, thinking as asked, tools as offered), and the bounds of the response store."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from agent_shapes import claude_code_body, codex_body
from tandem.server import anthropic_request, responses_request
from tandem.server.agent_request import EFFORT_BUDGETS, merge_system
from tandem.server.errors import APIError
from tandem.server.protocol import parse_chat, shown_names
from tandem.server.responses_request import ResponseStore


def test_merge_system_keeps_every_text_in_order() -> None:
    out = merge_system([{"role": "user", "content": "u"}, {"role": "system", "content": "a"},
                        {"role": "assistant", "content": "x"}, {"role": "system", "content": ""},
                        {"role": "system", "content": "b"}])
    assert out == [{"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "u"},
                   {"role": "assistant", "content": "x"}]
    assert merge_system([{"role": "user", "content": "u"}]) == [{"role": "user", "content": "u"}]


def test_claude_code_first_request_becomes_one_chat_request() -> None:
    body, ignored = anthropic_request.to_chat_body(claude_code_body(), {}, strict=False)
    assert ignored == ["context_management"]
    msgs = body["messages"]
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == ("x-anthropic-billing-header: cc_version=2.1.197;You are a Claude agent.\n"
                                  "You are an interactive agent.\n\nAvailable agent types for the Agent tool:\n"
                                  "- Explore: searches.")
    assert msgs[1]["content"].endswith("</system-reminder>\n\nsay hi")
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["thinking_token_budget"] == EFFORT_BUDGETS["high"] == 8192
    assert [t["function"]["name"] for t in body["tools"]] == ["Bash", "Read", "Edit", "TaskCreate"]
    req = parse_chat(body, strict=True)
    assert req.stream and req.max_tokens == 64000 and req.thinking_token_budget == 8192


@pytest.mark.parametrize(("thinking", "config", "defaults", "kwargs", "budget"), [
    ({"type": "adaptive"}, {"effort": "low"}, {}, {"enable_thinking": True}, 1024),
    ({"type": "adaptive"}, {"effort": "max"}, {}, {"enable_thinking": True}, None),
    ({"type": "adaptive"}, None, {"enable_thinking": False}, {}, None),  # the server's default decides
    ({"type": "enabled", "budget_tokens": 2000}, {"effort": "low"}, {}, {"enable_thinking": True}, 2000),
    ({"type": "disabled"}, {"effort": "high"}, {}, {"enable_thinking": False}, None),
    (None, None, {}, {"enable_thinking": False}, None),
])
def test_messages_thinking_and_effort(thinking: object, config: object, defaults: dict[str, object],
                                      kwargs: dict[str, object], budget: int | None) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "thinking": thinking,
            "output_config": config}
    out, _ = anthropic_request.to_chat_body({k: v for k, v in body.items() if v is not None}, defaults, False)
    assert out["chat_template_kwargs"] == kwargs and out.get("thinking_token_budget") == budget


def test_messages_blocks_read_as_text() -> None:
    content = [{"type": "tool_result", "tool_use_id": "toolu_1", "cache_control": {"type": "ephemeral"}, "content": [
        {"type": "text", "text": ""},
        {"type": "search_result", "title": "T", "source": "s.py", "content": [{"type": "text", "text": "body"}]},
        {"type": "tool_reference", "tool_name": "Read"}]},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}, "title": "D"},
        {"type": "text", "text": ""}]
    out, _ = anthropic_request.to_chat_body({"max_tokens": 4, "messages": [{"role": "user", "content": content}]},
                                            {}, False)
    assert out["messages"] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "T\ns.py\nbody[tool: Read]"},
                               {"role": "user", "content": "D\ndoc"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {"type": "base64", "data": "AA=="}}]}]}]}, "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "container": "c1"}, "container"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"type": "url"}]}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "adaptive"},
      "output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "xml"}}},
     "output_config.format"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools[0]"),
])
def test_messages_refusals_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as info:
        anthropic_request.to_chat_body({"max_tokens": 4, **body}, {}, False)
    assert info.value.status == 400 and info.value.param == param


def test_codex_first_request_becomes_one_chat_request() -> None:
    body, conversation, ignored = responses_request.to_chat_body(codex_body(), [], strict=False)
    assert ignored == ["client_metadata", "tools[5]:web_search"]
    msgs = body["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "user"]
    assert msgs[0]["content"] == ("You are a coding agent running in the Codex CLI.\n\n<skills_instructions>\n"
                                  "## Skills\n</skills_instructions>")
    assert [t["function"]["name"] for t in body["tools"]] == [
        "exec_command", "write_stdin", "view_image", "multi_agent_v1.close_agent", "multi_agent_v1.spawn_agent",
        "get_goal"]
    assert body["chat_template_kwargs"] == {} and "thinking_token_budget" not in body
    assert parse_chat(body, strict=True).tools is not None
    assert responses_request.namespace_members(codex_body()["tools"]) == {
        "multi_agent_v1.close_agent": ("multi_agent_v1", "close_agent"),
        "multi_agent_v1.spawn_agent": ("multi_agent_v1", "spawn_agent")}


def test_responses_instructions_developer_system_merge_in_order() -> None:
    items = [{"role": "user", "content": "u1"}, {"role": "developer", "content": "d"},
             {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]}]
    body, _, _ = responses_request.to_chat_body({"input": items, "instructions": "i"}, [], False)
    assert body["messages"] == [{"role": "system", "content": "i\n\nd\n\ns"}, {"role": "user", "content": "u1"}]


@pytest.mark.parametrize(("reasoning", "extra", "kwargs", "budget"), [
    ({"effort": "none"}, None, {"enable_thinking": False}, None),
    ({"effort": "minimal"}, None, {"enable_thinking": True}, 256),
    ({"effort": "medium", "summary": "auto"}, None, {"enable_thinking": True}, 4096),
    ({"effort": "high"}, {"enable_thinking": False}, {"enable_thinking": False}, 8192),
    (None, {"enable_thinking": False}, {"enable_thinking": False}, None),
])
def test_responses_reasoning_effort(reasoning: object, extra: object, kwargs: dict[str, object],
                                    budget: int | None) -> None:
    raw = {"input": "hi", "reasoning": reasoning, "chat_template_kwargs": extra}
    body, _, _ = responses_request.to_chat_body({k: v for k, v in raw.items() if v is not None}, [], False)
    assert body["chat_template_kwargs"] == kwargs and body.get("thinking_token_budget") == budget


def test_responses_default_effort_is_medium_unless_the_server_bounds_thinking() -> None:
    medium = EFFORT_BUDGETS["medium"]
    body, _, _ = responses_request.to_chat_body({"input": "hi", "reasoning": {"summary": "auto"}}, [], False, medium)
    assert body["thinking_token_budget"] == 4096 and body["chat_template_kwargs"] == {}
    body, _, _ = responses_request.to_chat_body({"input": "hi", "reasoning": {"effort": "low"}}, [], False, medium)
    assert body["thinking_token_budget"] == 1024
    body, _, _ = responses_request.to_chat_body({"input": "hi"}, [], False, None)  # --reasoning-budget decides
    assert "thinking_token_budget" not in body


def test_responses_history_items_keep_namespace_and_reasoning() -> None:
    items = [{"type": "reasoning", "summary": [], "encrypted_content": "thought"},
             {"type": "function_call", "name": "close_agent", "namespace": "multi_agent_v1", "call_id": "c1",
              "arguments": "{\"target\": \"a\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    msgs = responses_request.input_messages(items)
    assert msgs[0]["reasoning_content"] == "thought"
    assert msgs[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"
    assert msgs[1] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}


def test_responses_allowed_tools_narrow_the_tools() -> None:
    tools = [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}]
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]}
    body, _, _ = responses_request.to_chat_body({"input": "x", "tools": tools, "tool_choice": choice}, [], False)
    assert body["tool_choice"] == "required" and [t["function"]["name"] for t in body["tools"]] == ["b"]
    with pytest.raises(APIError) as info:
        responses_request.to_chat_body({"input": "x", "tools": [{"type": "custom", "name": "p"}]}, [], False)
    assert info.value.param == "tools[0]"


def test_response_store_is_bounded_in_bytes() -> None:
    messages = [{"role": "user", "content": "x" * 1000}]
    one = len(orjson.dumps({"messages": messages, "response": {"id": "r0"}}))
    store = ResponseStore(capacity=100, max_bytes=5 * one + 10)
    for i in range(8):
        store.put(f"r{i}", messages, {"id": f"r{i}"})
    assert len(store) == 5 and store.num_bytes == 5 * one
    assert store.response("r7") == {"id": "r7"} and store.get("r3") == messages
    with pytest.raises(APIError) as info:
        store.get("r2")
    assert info.value.status == 400 and info.value.code == "previous_response_not_found"
    with pytest.raises(APIError) as info:
        store.response("r0")
    assert info.value.status == 404
    store.put("big", [{"role": "user", "content": "y" * (6 * one)}])
    assert len(store) == 5 and store.num_bytes == 5 * one  # larger than the whole store: not kept


def test_ignored_names_are_printable_ascii() -> None:
    assert shown_names(["a\x00b", "東", "x,y", "é\n"]) == ["a\\x00b", "\\u6771", "x\\x2cy", "\\xe9\\n"]


@pytest.mark.parametrize(("choice", "tool_choice", "parallel"), [
    ({"type": "any"}, "required", True),  # several calls allowed, as Anthropic's `any`
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}, False),
])
def test_messages_tool_choice_semantics(choice: object, tool_choice: object, parallel: bool) -> None:
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": choice,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    out, _ = anthropic_request.to_chat_body(body, {}, False)
    assert out["tool_choice"] == tool_choice and out["parallel_tool_calls"] is parallel
    req = parse_chat(out, strict=True)
    assert req.parallel_tool_calls is parallel and req.tool_choice == tool_choice


def test_keepalive_ticks_while_the_source_is_silent() -> None:
    """A stream whose first chunk waits (a long prefill) yields None ticks, then the items in order; closing it
    early closes the source."""
    import asyncio

    from tandem.server.drive import with_keepalive

    closed: list[bool] = []

    async def main() -> list[object]:
        go = asyncio.Event()

        async def source() -> AsyncIterator[int]:
            try:
                await go.wait()
                yield 1
                yield 2
            finally:
                closed.append(True)

        seen: list[object] = []
        async for item in with_keepalive(source(), interval_s=0.01):
            seen.append(item)
            if item is None:
                go.set()
        return seen

    seen = asyncio.run(main())
    assert seen[-2:] == [1, 2] and set(seen[:-2]) == {None} and len(seen) >= 3 and closed == [True]


@pytest.mark.parametrize("reasoning", [True, False])
def test_messages_keepalive_opens_the_block_the_reply_starts_with(reasoning: bool) -> None:
    """While a prompt is prefilled the Messages stream sends a ping and an empty delta of the block the reply will
    start with; the reply's first text then continues that block (one block, no empty one left behind)."""
    from tandem.server.anthropic import _Blocks

    def parsed(pieces: list[bytes]) -> list[dict[str, object]]:
        return [orjson.loads(p.split(b"data: ", 1)[1]) for p in pieces]

    blocks = _Blocks()
    first = parsed(blocks.keepalive(reasoning))
    again = parsed(blocks.keepalive(reasoning))
    kind, delta = ("thinking", "thinking_delta") if reasoning else ("text", "text_delta")
    assert [e["type"] for e in first] == ["ping", "content_block_start", "content_block_delta"]
    assert first[1]["content_block"]["type"] == kind and first[2]["delta"]["type"] == delta
    assert [e["type"] for e in again] == ["ping", "content_block_delta"] and again[1]["index"] == 0
    reply = parsed(blocks.feed(("reasoning" if reasoning else "content", "hi")) + blocks.close())
    assert [e["type"] for e in reply] == ["content_block_delta", "content_block_stop"]
    assert all(e["index"] == 0 for e in reply)
