"""Each route's own API decides what is valid on it (tandem/server/api_rules.py): a value the route's official SDK
types or API reference forbid is a 400 in the route's error shape naming the field; the boundary values they
allow answer 200. The session's keyed server of the embedded model (server_fixtures.keyed_server)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from server_fixtures import API_KEY, ServerProcess

AUTH = {"x-api-key": API_KEY}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hi", "max_tokens": 1}
MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COUNT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"input": "hi", "max_output_tokens": 16}
TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def server(keyed_server: ServerProcess) -> ServerProcess:
    return keyed_server


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


OPENAI_FORBIDDEN = [
    ("/v1/chat/completions", CHAT, {"temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", CHAT, {"temperature": -0.1}, "temperature"),
    ("/v1/chat/completions", CHAT, {"top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", CHAT, {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", CHAT, {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", CHAT, {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", CHAT, {"n": 0}, "n"),
    ("/v1/chat/completions", CHAT, {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", CHAT, {"verbosity": "loud"}, "verbosity"),
    ("/v1/chat/completions", CHAT, {"service_tier": "gold"}, "service_tier"),
    ("/v1/completions", COMPLETION, {"logprobs": 6}, "logprobs"),
    ("/v1/completions", COMPLETION, {"temperature": 2.01}, "temperature"),
    ("/v1/completions", COMPLETION, {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", COMPLETION, {"service_tier": 1}, "service_tier"),
]


@pytest.mark.parametrize(("path", "base", "extra", "field"), OPENAI_FORBIDDEN)
def test_openai_forbidden(server: ServerProcess, path: str, base: dict[str, Any], extra: dict[str, Any],
                          field: str) -> None:
    r = _post(server, path, {**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field
    assert field in err["message"]


OPENAI_ALLOWED = [
    ("/v1/chat/completions", CHAT, {"temperature": 2, "top_p": 1, "presence_penalty": -2, "frequency_penalty": 2}),
    ("/v1/chat/completions", CHAT, {"temperature": 1, "top_p": 0, "stop": [str(i) for i in range(16)]}),
    ("/v1/completions", COMPLETION, {"top_p": 0.0}),
    ("/v1/chat/completions", CHAT, {"temperature": 0, "presence_penalty": 2, "frequency_penalty": -2}),
    ("/v1/chat/completions", CHAT, {"logprobs": True, "top_logprobs": 20}),
    ("/v1/chat/completions", CHAT, {"logprobs": True, "top_logprobs": 0, "max_completion_tokens": 1}),
    ("/v1/chat/completions", CHAT, {"reasoning_effort": "minimal", "verbosity": "high", "service_tier": "flex"}),
    ("/v1/chat/completions", CHAT, {"reasoning_effort": None, "verbosity": None, "service_tier": None}),
    ("/v1/completions", COMPLETION, {"logprobs": 5, "temperature": 2, "service_tier": "auto"}),
    ("/v1/completions", COMPLETION, {"logprobs": 0}),
]


@pytest.mark.parametrize(("path", "base", "extra"), OPENAI_ALLOWED)
def test_openai_allowed(server: ServerProcess, path: str, base: dict[str, Any], extra: dict[str, Any]) -> None:
    r = _post(server, path, {**base, **extra})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


ANTHROPIC_FORBIDDEN = [
    (MESSAGES, {"temperature": 1.5}, "temperature"),
    (MESSAGES, {"temperature": -0.5}, "temperature"),
    (MESSAGES, {"top_p": 1.1}, "top_p"),
    (MESSAGES, {"top_k": -1}, "top_k"),
    (MESSAGES, {"top_k": 2.5}, "top_k"),
    (MESSAGES, {"max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": MESSAGES["messages"]}, {}, "max_tokens"),
    (MESSAGES, {"stop_sequences": "END"}, "stop_sequences"),
    (MESSAGES, {"stop_sequences": ["END", 3]}, "stop_sequences"),
    (MESSAGES, {"tools": [TOOL], "tool_choice": {"type": "required"}}, "tool_choice"),
    (MESSAGES, {"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    (MESSAGES, {"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking.budget_tokens"),
    (MESSAGES, {"thinking": {"type": "enabled", "budget_tokens": 1023}, "max_tokens": 2000},
     "thinking.budget_tokens"),
    (MESSAGES, {"thinking": {"type": "enabled"}, "max_tokens": 2000}, "thinking.budget_tokens"),
    (MESSAGES, {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024}, "max_tokens"),
    ({"messages": MESSAGES["messages"], "max_tokens": 1}, {}, "model"),
    (MESSAGES, {"model": ""}, "model"),
    (MESSAGES, {"model": 7}, "model"),
    (COUNT, {"model": None}, "model"),
    (COUNT, {"thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking.budget_tokens"),
    (MESSAGES, {"service_tier": "priority"}, "service_tier"),
    (MESSAGES, {"metadata": "user-1"}, "metadata"),
    (COUNT, {"temperature": 1.5}, "temperature"),
    (COUNT, {"stop_sequences": "END"}, "stop_sequences"),
]


@pytest.mark.parametrize(("base", "extra", "field"), ANTHROPIC_FORBIDDEN)
def test_anthropic_forbidden(server: ServerProcess, base: dict[str, Any], extra: dict[str, Any],
                             field: str) -> None:
    path = "/v1/messages/count_tokens" if base is COUNT else "/v1/messages"
    r = _post(server, path, {k: v for k, v in {**base, **extra}.items() if v is not None})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"]


ANTHROPIC_ALLOWED = [
    {"temperature": 1, "top_p": 1, "top_k": 0},
    {"temperature": 0, "top_k": 5, "stop_sequences": []},
    {"stop_sequences": ["END", "STOP"], "service_tier": "standard_only", "metadata": {"user_id": "u"}},
    {"tools": [TOOL], "tool_choice": {"type": "any"}},
    {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "f"}},
    {"tools": [TOOL], "tool_choice": {"type": "none"}},
    {"temperature": 0, "top_p": 0},  # the most likely token alone
    {"thinking": {"type": "disabled"}, "stop_sequences": [str(i) for i in range(16)]},  # vLLM's many stops
]


@pytest.mark.parametrize("extra", ANTHROPIC_ALLOWED)
def test_anthropic_allowed(server: ServerProcess, extra: dict[str, Any]) -> None:
    r = _post(server, "/v1/messages", {**MESSAGES, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"


def test_count_tokens_takes_no_max_tokens(server: ServerProcess) -> None:
    r = _post(server, "/v1/messages/count_tokens", {**COUNT, "temperature": 1, "top_k": 0,
                                                    "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > 0


def test_interleaved_thinking_budget_may_exceed_max_tokens(server: ServerProcess) -> None:
    body = {**MESSAGES, "max_tokens": 3, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    plain = _post(server, "/v1/messages", body)
    assert plain.status_code == 400 and "max_tokens" in plain.json()["error"]["message"], plain.text
    beta = httpx.post(server.url + "/v1/messages", json=body, timeout=120,
                      headers={**AUTH, "anthropic-beta": "claude-code-20250219, interleaved-thinking-2025-05-14"})
    assert beta.status_code == 200, beta.text
    # three sampled tokens of thinking (a blank thinking text is left out, as a blank text block is)
    assert beta.json()["stop_reason"] == "max_tokens"
    assert all(block["type"] == "thinking" for block in beta.json()["content"]), beta.text


RESPONSES_FORBIDDEN = [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 15}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"truncation": "middle"}, "truncation"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"name": "f"}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
]


@pytest.mark.parametrize(("extra", "field"), RESPONSES_FORBIDDEN)
def test_responses_forbidden(server: ServerProcess, extra: dict[str, Any], field: str) -> None:
    r = _post(server, "/v1/responses", {**RESPONSES, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field
    assert field in err["message"]


RESPONSES_ALLOWED = [
    {"temperature": 2, "top_p": 1, "top_logprobs": 20, "truncation": "disabled"},
    {"temperature": 0, "top_logprobs": 0, "truncation": "auto", "service_tier": "default"},
    {"tool_choice": "none"},
    {"tools": [FN], "tool_choice": "required", "max_output_tokens": 16, "parallel_tool_calls": False},
    {"tools": [FN], "tool_choice": {"type": "function", "name": "f"}, "max_tool_calls": 1},
]


@pytest.mark.parametrize("extra", RESPONSES_ALLOWED)
def test_responses_allowed(server: ServerProcess, extra: dict[str, Any]) -> None:
    r = _post(server, "/v1/responses", {**RESPONSES, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response"


def test_official_clients_read_the_400(server: ServerProcess) -> None:
    """The SDKs raise their BadRequestError with the field named, as against the real APIs."""
    import anthropic
    import openai

    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=1, messages=MESSAGES["messages"],
                               extra_body={"temperature": 1.5})  # anthropic 2.x types no sampling fields
    assert caught.value.status_code == 400
    assert "temperature" in caught.value.message
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as bad:
        bad_truncation: Any = "middle"
        oai.responses.create(model="default", input="hi", max_output_tokens=16, truncation=bad_truncation)
    assert bad.value.code == "invalid_value"
    assert bad.value.param == "truncation"
