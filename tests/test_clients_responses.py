"""The OpenAI Responses API through the official openai client against a real server with the embedded model:
create, the typed stream, function calls (whole and streamed), input items, text.format, and
previous_response_id from the in-memory store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from server_fixtures import EMBEDDED, ServerProcess

NOTE = {"type": "function", "name": "save_note", "description": "save a note", "parameters": {
    "type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "priority", "tags"]}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(EMBEDDED, "--max-context", "2048", "--max-stored-responses", "2")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_create_and_stream_agree(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="default", input="def add(a, b):", instructions="Write Python.",
                                  max_output_tokens=40, temperature=0)
    r = client.responses.create(**kwargs)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.usage is not None and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 40
    if any(item.type == "reasoning" for item in r.output):  # the template opens a think block
        assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    kinds = {item.type for item in r.output}
    assert kinds <= {"reasoning", "message"} and kinds
    types: list[str] = []
    deltas = ""
    final = None
    for event in client.responses.create(**kwargs, stream=True):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == f"response.{r.status}"
    assert final is not None and final.output_text == deltas == r.output_text
    assert [i.type for i in final.output] == [i.type for i in r.output]


def test_function_call_whole_and_streamed(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="default", input=[{"role": "user", "content": "note"}], tools=[NOTE],
                                  tool_choice={"type": "function", "name": "save_note"}, max_output_tokens=160,
                                  temperature=0)
    r = client.responses.create(**kwargs)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "save_note"
    jsonschema.validate(json.loads(calls[0].arguments), NOTE["parameters"])  # type: ignore[arg-type]
    deltas, done = "", ""
    for event in client.responses.create(**kwargs, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas += event.delta
        if event.type == "response.function_call_arguments.done":
            done = event.arguments
    assert deltas == done == calls[0].arguments
    follow = client.responses.create(model="default", tools=[NOTE], max_output_tokens=16, input=[  # type: ignore
        {"role": "user", "content": "note"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "save_note", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "saved"}])
    assert follow.status in ("completed", "incomplete")


def test_json_schema_format(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model="default", input="a number", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_from_the_store(client: OpenAI) -> None:
    first = client.responses.create(model="default", input="x = 1", max_output_tokens=16, temperature=0)
    second = client.responses.create(model="default", input="y = 2", max_output_tokens=16, temperature=0,
                                     previous_response_id=first.id)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2  # history is in
    unstored = client.responses.create(model="default", input="z", max_output_tokens=16, store=False)
    for _ in range(2):  # the store keeps two: `first` falls out
        client.responses.create(model="default", input="w", max_output_tokens=16)
    for gone in (first.id, unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="default", input="q", max_output_tokens=16, previous_response_id=gone)
        assert "previous_response_id" in str(info.value)
