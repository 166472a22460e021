"""Forced tool calls through the official openai client against a real server with the embedded model: a named
and a "required" tool_choice with string, integer and array arguments give exactly one schema-valid call, the
streamed argument deltas join to the non-streamed JSON, and a call cut off by max_tokens leaves nothing behind."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from server_fixtures import API_KEY, ServerProcess

SAVE = {"type": "function", "function": {"name": "save_note", "description": "save a note", "parameters": {
    "type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "priority", "tags"]}}}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                                     "step": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["values", "step"]}}}
SCHEMAS = {"save_note": SAVE["function"]["parameters"], "count": COUNT["function"]["parameters"]}  # type: ignore


@pytest.fixture(scope="module")
def client(keyed_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=keyed_server.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


def _streamed(client: OpenAI, kwargs: dict[str, Any]) -> tuple[list[tuple[str, str]], str | None, str]:
    parts: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                slot = parts.setdefault(d.index, {"name": "", "args": ""})
                if d.function is not None:
                    slot["name"] += d.function.name or ""
                    slot["args"] += d.function.arguments or ""
    return [(p["name"], p["args"]) for _, p in sorted(parts.items())], finish, content


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_call_streamed_equals_whole(client: OpenAI, choice: str) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "save_note"}} if choice == "named" else "required"
    kwargs: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": "save a note"}],
                                  tools=[SAVE, COUNT], tool_choice=tool_choice, max_tokens=160, temperature=0)
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]  # type: ignore[union-attr]
    assert len(calls) == 1
    name, args = calls[0]
    assert choice == "required" or name == "save_note"
    jsonschema.validate(json.loads(args), SCHEMAS[name])
    streamed, finish, content = _streamed(client, kwargs)
    assert finish == "tool_calls" and content == ""
    assert streamed == calls  # the argument deltas join to the very JSON of the whole response


def test_named_call_with_integer_array(client: OpenAI) -> None:
    for seed in (1, 2):
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "count"}],
                                           tools=[SAVE, COUNT], max_tokens=120, seed=seed, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "count"}},
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
        jsonschema.validate(args, SCHEMAS["count"])
        assert isinstance(args["values"], list) and isinstance(args["step"], int)


def test_cut_off_call_leaves_nothing(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": "x"}], tools=[SAVE],
                                  tool_choice="required", max_tokens=6, temperature=0,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and not msg.tool_calls
    assert "<tool_call" not in (msg.content or "") and "<function" not in (msg.content or "")
    streamed, finish, content = _streamed(client, kwargs)
    assert finish == "length" and streamed == [] and "<tool_call" not in content
