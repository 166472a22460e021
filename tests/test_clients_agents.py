"""What coding agents send, through the official `anthropic` and `openai` clients against a real server with the
embedded model: Claude Code's and Codex CLI's first-request shapes replayed over HTTP, a system message inside
`messages`, adaptive thinking with an effort, beta headers and fields, nested tool results, namespace and hosted
tools, developer items, reasoning effort, GET /v1/responses/{id}, and field names no header can hold."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from agent_shapes import CLAUDE_CODE_HEADERS, claude_code_body, codex_body
from server_fixtures import API_KEY as KEY
from server_fixtures import ServerProcess
USER: list[Any] = [{"role": "user", "content": "def add(a, b):"}]
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.", "tools": [
    {"type": "function", "name": "close_agent", "description": "close an agent", "parameters": {
        "type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}]}


@pytest.fixture(scope="module")
def server(keyed_server: ServerProcess) -> ServerProcess:
    return keyed_server


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=600, max_retries=0)


def _events(lines: Iterator[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_claude_code_first_request_replayed(server: ServerProcess) -> None:
    body = claude_code_body(max_tokens=12)
    headers = {**CLAUDE_CODE_HEADERS, "x-api-key": KEY}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["x-tandem-ignored-fields"] == "context_management"
        events = _events(r.iter_lines())
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "error" not in kinds
    assert events[0]["message"]["model"] == "claude-opus-4-8"
    # adaptive thinking at effort high: the reply opens with a thinking block
    assert next(e for e in events if e["type"] == "content_block_start")["content_block"]["type"] == "thinking"


def test_system_message_inside_messages_is_folded(claude: anthropic.Anthropic) -> None:
    inside: Any = [*USER, {"role": "system", "content": "Answer in Python."}]
    folded = claude.messages.count_tokens(model="m", system="You write code.\n\nAnswer in Python.", messages=USER)
    counted = claude.messages.count_tokens(model="m", system="You write code.", messages=inside)
    assert counted.input_tokens == folded.input_tokens > 0
    m = claude.messages.create(model="m", max_tokens=4, system="You write code.", messages=inside)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == folded.input_tokens


def test_adaptive_thinking_and_effort(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model="m", max_tokens=6, messages=USER, thinking={"type": "adaptive"},
                               output_config={"effort": "low"}, extra_body={"temperature": 0})
    assert m.content[0].type == "thinking"
    plain = claude.messages.create(model="m", max_tokens=6, messages=USER, extra_body={"temperature": 0},
                                   output_config={"effort": "low"})
    assert [b.type for b in plain.content] == ["text"]


def test_beta_fields_headers_and_cache_control(claude: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": [
        {"type": "text", "text": ""},
        {"type": "text", "text": "def add(a, b):", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]
    m = claude.beta.messages.with_raw_response.create(
        model="m", max_tokens=4, messages=messages, betas=["context-management-2025-06-27", "made-up-2099-01-01"],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        system=[{"type": "text", "text": "You write code.", "cache_control": {"type": "ephemeral"}}],
        cache_control={"type": "ephemeral"},
        extra_body={"temperature": 0})  # greedy: a sampled reply may end within 4 tokens
    assert m.status_code == 200 and m.headers["x-tandem-ignored-fields"] == "context_management"
    assert m.parse().stop_reason == "max_tokens"


def test_nested_tool_result_content(claude: anthropic.Anthropic) -> None:
    tool: Any = {"name": "Read", "description": "read a file", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
    history: Any = [
        {"role": "user", "content": "read a.py"},
        {"role": "assistant", "content": [{"type": "text", "text": ""}, {
            "type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "def add(a, b):\n    return a + b\n"},
            {"type": "search_result", "title": "a.py", "source": "a.py",
             "content": [{"type": "text", "text": "add"}]}]}]}]
    m = claude.messages.create(model="m", max_tokens=4, messages=history, tools=[tool])
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use") and m.usage.input_tokens > 0


def test_codex_first_request_replayed(server: ServerProcess) -> None:
    body = {**codex_body(), "max_output_tokens": 16}
    headers = {"authorization": f"Bearer {KEY}", "accept": "text/event-stream"}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["x-tandem-ignored-fields"] == "client_metadata,tools[5]:web_search"
        events = _events(r.iter_lines())
    created = events[0]
    assert created["type"] == "response.created" and created["sequence_number"] == 0
    assert created["response"]["model"] == "default" and created["response"]["created_at"] > 0
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    reasoning = [i for i in events[-1]["response"]["output"] if i["type"] == "reasoning"]
    assert all(i["encrypted_content"] == i["content"][0]["text"] for i in reasoning)  # include asked for it


def test_namespace_tool_call_whole_and_streamed(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="default", input="close agent a", tools=[NAMESPACE], max_output_tokens=60,
                                  tool_choice={"type": "function", "name": "multi_agent_v1.close_agent"},
                                  reasoning={"effort": "none"}, temperature=0)
    r = oai.responses.create(**kwargs)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "close_agent" and calls[0].namespace == "multi_agent_v1"
    assert isinstance(json.loads(calls[0].arguments)["target"], str)
    deltas, done, item_done = "", None, None
    for event in oai.responses.create(**kwargs, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas += event.delta
        elif event.type == "response.function_call_arguments.done":
            done = event.arguments
        elif event.type == "response.output_item.done" and event.item.type == "function_call":
            item_done = event.item
    assert item_done is not None and item_done.namespace == "multi_agent_v1"
    assert deltas == done == item_done.arguments == calls[0].arguments


def test_developer_items_merge_into_the_system_turn(oai: openai.OpenAI) -> None:
    items: Any = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"},
                  {"role": "system", "content": "Use Python."}]
    r = oai.responses.create(model="default", instructions="You write code.", input=items, max_output_tokens=16)
    chat = oai.chat.completions.create(model="default", max_tokens=2, messages=[
        {"role": "system", "content": "You write code.\n\nBe brief.\n\nUse Python."},
        {"role": "user", "content": "def add(a, b):"}])
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_reasoning_effort_switches_thinking(oai: openai.OpenAI) -> None:
    off = oai.responses.create(model="default", input="def add(a, b):", max_output_tokens=16, temperature=0,
                               reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"]
    low = oai.responses.create(model="default", input="def add(a, b):", max_output_tokens=16, temperature=0,
                               reasoning={"effort": "low"})
    assert low.output[0].type == "reasoning"
    kwargs = oai.responses.create(model="default", input="def add(a, b):", max_output_tokens=16, temperature=0,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [i.type for i in kwargs.output] == ["message"] and kwargs.output_text == off.output_text


def test_get_stored_response(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="default", input="def add(a, b):", max_output_tokens=16)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    assert got.usage is not None and r.usage is not None and got.usage.output_tokens == r.usage.output_tokens
    unstored = oai.responses.create(model="default", input="x", max_output_tokens=16, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
def test_field_names_no_header_can_hold(server: ServerProcess, route: str) -> None:
    body: dict[str, Any] = {"model": "default", "max_tokens": 2, "a\u0000b": 1, "東": 2}
    if route == "/v1/responses":
        body = {"model": "default", "input": "hi", "max_output_tokens": 16, "a\u0000b": 1, "東": 2}
    else:
        body["messages"] = USER
    r = httpx.post(server.url + route, json=body, headers={"x-api-key": KEY}, timeout=120)
    assert r.status_code == 200 and r.headers["x-tandem-ignored-fields"] == "a\\x00b,\\u6771"


def test_tokenize_and_detokenize(server: ServerProcess, oai: openai.OpenAI) -> None:
    headers = {"x-api-key": KEY}
    r = httpx.post(server.url + "/tokenize", json={"prompt": "def add(a, b):"}, headers=headers).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048 and r["token_strs"] is None
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=headers).json()
    assert back == {"prompt": "def add(a, b):"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": USER}, headers=headers).json()
    done = oai.chat.completions.create(model="default", messages=USER, max_tokens=1)
    assert done.usage is not None and chat["count"] == done.usage.prompt_tokens
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [-1]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_client_errors_are_logged_in_one_line(server: ServerProcess) -> None:
    before = len(server.errors)  # the session's server: earlier modules' lines stay
    r = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": KEY},
                   json={"messages": USER, "max_tokens": -1, "stop": "x" * 5000})
    assert r.status_code == 400
    deadline = time.monotonic() + 10  # the server's stderr is read on a thread
    while not (lines := [line for line in server.errors[before:] if "chat 400: max_tokens:" in line]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 1 and "'max_tokens' must be an integer >= 1" in lines[0] and len(lines[0]) < 400
