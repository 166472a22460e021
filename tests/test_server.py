"""The server through the official openai client, against a real Hypercorn process on loopback (tiny model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from server_fixtures import ServerProcess

NO_THINK = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "London"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}


@pytest.fixture(scope="session")
def model_dir(served_model: Path) -> Path:
    return served_model


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir, "--max-queue", "8", "--queue-timeout", "30", "--max-context", "2048")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_and_health(server: ServerProcess, model: str, model_dir: Path) -> None:
    assert model == model_dir.name
    assert server.request("GET", "/health").json()["status"] == "ok"


def test_chat_non_streaming(client: OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                       seed=3)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    text = (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")
    assert isinstance(text, str)


def _collect(stream: Any) -> tuple[str, str, list[Any], str | None, Any]:
    content, reasoning, chunks, finish, usage = [], [], [], None, None
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content.append(c.delta.content or "")
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            finish = c.finish_reason or finish
    return "".join(content), "".join(reasoning), chunks, finish, usage


def test_chat_streaming_equals_non_streaming(client: OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": "tell me"}], max_tokens=40,
                                  seed=11, temperature=1.0)
    whole = client.chat.completions.create(**kwargs)
    content, reasoning, chunks, finish, usage = _collect(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    msg = whole.choices[0].message
    assert content == (msg.content or "")
    assert reasoning == (getattr(msg, "reasoning_content", None) or "")
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert len(chunks) > 3


def test_completions_streaming_and_not(client: OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="the city of", max_tokens=20, seed=5)
    parts = [c.choices[0].text for c in client.completions.create(model=model, prompt="the city of",
                                                                  max_tokens=20, seed=5, stream=True)
             if c.choices]
    assert "".join(parts) == whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens >= 1


def test_seed_reproducible_and_n(client: OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, prompt="weather in", max_tokens=16, temperature=1.0, seed=1234)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(**kwargs, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == a.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=8, seed=9, **NO_THINK)  # type: ignore[arg-type]
    assert len(chat.choices) == 2


def test_logprobs(client: OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                       logprobs=True, top_logprobs=3, seed=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 6
    for entry in lp.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    c = client.completions.create(model=model, prompt="a", max_tokens=5, logprobs=2, seed=2,
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].logprobs is not None and len(c.choices[0].logprobs.tokens or []) == 5


def _junction_stop(text: str, tokens: list[str]) -> str | None:
    """A 2-4 character printable stop string that starts inside one token and ends in the next, first seen there."""
    for j in range(len(tokens) - 1):
        prefix = "".join(tokens[:j + 1])
        if not text.startswith(prefix):
            return None  # a token holding part of a character: offsets past it are not exact
        cand = tokens[j][-2:] + tokens[j + 1][:2]
        if len(tokens[j]) and len(tokens[j + 1]) and cand.isascii() and cand.isprintable() \
                and text.find(cand) == len(prefix) - len(tokens[j][-2:]) > 2:
            return cand
    return None


def test_stop_string_split_across_tokens(client: OpenAI, model: str) -> None:
    for seed in range(40):
        base: dict[str, Any] = dict(model=model, prompt="the weather in Paris", max_tokens=40, seed=seed,
                                    temperature=1.0, extra_body={"ignore_eos": True})
        full = client.completions.create(**base, logprobs=0)
        text = full.choices[0].text
        stop = _junction_stop(text, full.choices[0].logprobs.tokens or [])  # type: ignore[union-attr]
        if stop is not None:
            break
    assert stop is not None, "no token boundary to test on"
    expected = text[:text.find(stop)]
    cut = client.completions.create(**base, stop=[stop])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stop=stop, stream=True)
                       if c.choices)
    assert streamed == expected
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                          seed=seed, stop=[stop], extra_body={"ignore_eos": True})
    assert stop not in (chat.choices[0].message.content or "")


def test_tools_required_streaming(client: OpenAI, model: str) -> None:
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": "weather?"}],
                                      tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                      max_tokens=120, seed=4, **NO_THINK)
        if not stream:
            r = client.chat.completions.create(**kwargs)
            calls = r.choices[0].message.tool_calls or []
            assert r.choices[0].finish_reason == "tool_calls"
            got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]  # type: ignore[union-attr]
        else:
            parts: dict[int, dict[str, str]] = {}
            finish = None
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for ch in chunk.choices:
                    finish = ch.finish_reason or finish
                    for d in ch.delta.tool_calls or []:
                        slot = parts.setdefault(d.index, {"name": "", "args": ""})
                        if d.function is not None:
                            slot["name"] += d.function.name or ""
                            slot["args"] += d.function.arguments or ""
            assert finish == "tool_calls"
            got = [(p["name"], json.loads(p["args"])) for _, p in sorted(parts.items())]
        assert len(got) == 1
        name, args = got[0]
        schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]  # type: ignore[index]
        jsonschema.validate(args, schema)


def test_named_tool_with_thinking(client: OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "paris?"}],
                                       tools=[WEATHER, TIME], max_tokens=160, seed=8,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"] * len(calls) and calls  # type: ignore[union-attr]
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])  # type: ignore
    assert r.choices[0].message.content is None


def test_json_schema_response(client: OpenAI, model: str) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"type": "boolean"},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": "a person"}],
                                      max_tokens=120, seed=21, response_format={"type": "json_schema", "json_schema": {
                                          "name": "person", "schema": schema, "strict": True}})
        if stream:
            text, _, _, finish, _ = _collect(client.chat.completions.create(**kwargs, stream=True))
        else:
            r = client.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)
    obj = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=200,
                                         seed=1, response_format={"type": "json_object"}, **NO_THINK)  # type: ignore
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_metrics(server: ServerProcess) -> None:
    text = server.request("GET", "/metrics").text
    for name in ("tandem_requests_total", "tandem_queue_depth", "tandem_time_to_first_token_seconds_bucket",
                 "tandem_decode_tokens_per_second", "tandem_tokens_per_round_bucket"):
        assert name in text
