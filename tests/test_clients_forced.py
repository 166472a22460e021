"""Forced tool calls hold while the model thinks, on all three APIs, streamed and whole, through the official clients
against a real server with the embedded model: Chat Completions' tool_choice "required", the Responses API's named
function, Anthropic's `any` with thinking enabled. Each request ends with the call after its reasoning. (The many
seeds and temperatures are in tests/test_forced_calls.py, at the engine.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from server_fixtures import REPO_ROOT, ServerProcess

EMBEDDED = REPO_ROOT / "tandem" / "assets" / "default"
KEY = "sk-forced"
SCHEMA = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
PROMPT = "Thanks!"  # the embedded model, unconstrained, often ends its reasoning here with eos
TEMPERATURES = (0.6, 1.4)
SEEDS = (1, 0)  # chat: seed 1 at 0.6 ended after 19 reasoning tokens with eos and no call before the fix


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(EMBEDDED, "--max-context", "2048", "--api-key", KEY)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_required(oai: OpenAI, stream: bool) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    for seed, temperature in zip(SEEDS, TEMPERATURES):
        kwargs: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": PROMPT}], tools=tools,
                                      tool_choice="required", temperature=temperature, seed=seed, max_tokens=64)
        if not stream:
            choice = oai.chat.completions.create(**kwargs).choices[0]
            reasoning = getattr(choice.message, "reasoning_content", None) or ""
            names = [c.function.name for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
            finish = choice.finish_reason
        else:
            reasoning, names, finish = "", [], None
            for chunk in oai.chat.completions.create(**kwargs, stream=True):
                delta: Any = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                names += [c.function.name for c in delta.tool_calls or [] if c.function and c.function.name]
                finish = chunk.choices[0].finish_reason or finish
        assert reasoning and finish == "tool_calls" and names == ["get_weather"], (temperature, finish, names)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_named(oai: OpenAI, stream: bool) -> None:
    for temperature in TEMPERATURES:
        kwargs: dict[str, Any] = dict(
            model="default", input=PROMPT, temperature=temperature, max_output_tokens=64,
            tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
            tool_choice={"type": "function", "name": "get_weather"}, reasoning={"effort": "low"})
        if not stream:
            r = oai.responses.create(**kwargs)
        else:
            events = list(oai.responses.create(**kwargs, stream=True))
            assert events[-1].type == "response.completed"
            r = events[-1].response  # type: ignore[union-attr]
        kinds = [item.type for item in r.output]
        assert r.status == "completed" and kinds == ["reasoning", "function_call"], (temperature, kinds)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_any_with_thinking(server: ServerProcess, stream: bool) -> None:
    # Anthropic's rules: budget_tokens >= 1,024 and below max_tokens; the reasoning is closed at half the budget
    # (the answer's reserve), the call follows. The stream is read until the call's block starts.
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=300, max_retries=0)
    kwargs: dict[str, Any] = dict(
        model="claude-any", max_tokens=1025, messages=[{"role": "user", "content": PROMPT}],
        tools=[{"name": "get_weather", "input_schema": SCHEMA}], tool_choice={"type": "any"},
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 1.0})
    if not stream:
        m = client.messages.create(**kwargs)
        kinds = [block.type for block in m.content]
        assert m.stop_reason == "tool_use" and kinds[0] == "thinking" and kinds[-1] == "tool_use", kinds
        return
    kinds = []
    with client.messages.stream(**kwargs) as events:
        for event in events:
            if event.type == "content_block_start":
                kinds.append(event.content_block.type)
                if event.content_block.type == "tool_use":
                    break
    assert kinds[0] == "thinking" and kinds[-1] == "tool_use", kinds
