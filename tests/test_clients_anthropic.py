"""The Anthropic Messages API through the official `anthropic` client against a real server with the embedded model
and an API key: create, stream (the event sequence), tools (tool_use / tool_result), the thinking budget's bounds
(>= 1024 and below max_tokens but under the interleaved-thinking beta), count_tokens, and errors in Anthropic's
shape (max_tokens and model required)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from server_fixtures import API_KEY as KEY
from server_fixtures import ServerProcess
NOTE = {"name": "save_note", "description": "save a note", "input_schema": {
    "type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "priority"]}}
USER = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server(keyed_server: ServerProcess) -> ServerProcess:
    return keyed_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=120, max_retries=0)


def test_create_and_stream_agree(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model="claude-any", max_tokens=24, messages=USER, system="You write Python.",
                                  extra_body={"temperature": 0})
    m = client.messages.create(**kwargs)
    assert m.type == "message" and m.role == "assistant" and m.model == "claude-any"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content and m.content[0].type == "text"
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24 and m.usage.cache_read_input_tokens == 0
    kinds: list[str] = []
    text = ""
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"  # the client drops pings
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta")
    assert final.content[0].text == text == m.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_forced_tool_use_whole_and_streamed(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model="m", max_tokens=120, messages=[{"role": "user", "content": "note it"}],
                                  tools=[NOTE], tool_choice={"type": "tool", "name": "save_note"},
                                  extra_body={"temperature": 0})
    m = client.messages.create(**kwargs)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "save_note"
    jsonschema.validate(uses[0].input, NOTE["input_schema"])
    partial = ""
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial += event.delta.partial_json
        final = stream.get_final_message()
    assert json.loads(partial) == uses[0].input
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    any_tool = client.messages.create(**{**kwargs, "tool_choice": {"type": "any"}})
    assert any_tool.stop_reason == "tool_use"
    history = [{"role": "user", "content": "note it"},
               {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {
                   "type": "tool_use", "id": uses[0].id, "name": "save_note", "input": uses[0].input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "saved"},
                                            {"type": "text", "text": "thanks"}]}]
    follow = client.messages.create(model="m", max_tokens=8, messages=history, tools=[NOTE],  # type: ignore
                                    tool_choice={"type": "none"})
    assert follow.stop_reason in ("end_turn", "max_tokens")


def test_thinking_budget_and_blocks(client: anthropic.Anthropic) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}  # Anthropic's least budget
    m = client.messages.create(model="m", max_tokens=24, messages=USER, extra_body={"temperature": 0},  # type: ignore
                               thinking=thinking, extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert m.content[0].type == "thinking" and m.content[0].thinking  # the budget may pass max_tokens under the beta
    for bad, field in (({"type": "enabled", "budget_tokens": 6}, "thinking.budget_tokens"), (thinking, "max_tokens")):
        with pytest.raises(anthropic.BadRequestError, match=field):  # below 1024; not below max_tokens
            client.messages.create(model="m", max_tokens=24, messages=USER, thinking=bad)  # type: ignore[arg-type]
    plain = client.messages.create(model="m", max_tokens=10, messages=USER)  # type: ignore[arg-type]
    assert all(b.type != "thinking" for b in plain.content)  # no thinking unless asked for, as Anthropic does


def test_stop_sequences_and_count_tokens(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="m", max_tokens=30, messages=USER,  # type: ignore[arg-type]
                               extra_body={"temperature": 0})
    text = m.content[0].text  # type: ignore[union-attr]
    assert len(text) > 4
    stop = text[2:4]
    s = client.messages.create(model="m", max_tokens=30, messages=USER,  # type: ignore[arg-type]
                               extra_body={"temperature": 0}, stop_sequences=[stop])
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop
    counted = client.messages.count_tokens(model="m", messages=USER)  # type: ignore[arg-type]
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)  # the prompt's


def test_errors_in_anthropic_shape(server: ServerProcess, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=USER)  # type: ignore[arg-type]
    assert info.value.status_code == 401
    image = [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", max_tokens=4, messages=image)  # type: ignore[arg-type]
    assert "image" in str(bad.value)
    for body, field in (({"model": "m", "messages": USER}, "max_tokens"),
                        ({"max_tokens": 4, "messages": USER}, "model")):
        r = httpx.post(server.url + "/v1/messages", json=body,
                       headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error" and field in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    with httpx.stream("POST", server.url + "/v1/messages", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "m", "messages": USER, "max_tokens": 3, "stream": True}) as raw:
        names = [line.split(": ", 1)[1] for line in raw.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
