"""The Responses API by the spec against a real server with the embedded model: the response object's fields (both
OpenAI's and Open Responses' required ones), the compaction endpoint and the compaction_trigger item, and the
WebSocket mode (the key on the upgrade, sequential turns, continuation of a store:false response on its socket,
previous_response_not_found after a reconnect and after a failed continuation, cancellation on close). The
compliance suite itself runs in tests/test_responses_compliance.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from server_fixtures import REPO_ROOT, ServerProcess

EMBEDDED = REPO_ROOT / "tandem" / "assets" / "default"
KEY = "sk-modes"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUICK = {"model": "default", "max_output_tokens": 16, "reasoning": {"effort": "none"}}
# Open Responses' ResponseResource: every field it requires (OpenAI's Response requires a subset of them)
REQUIRED = {"id", "object", "created_at", "completed_at", "status", "incomplete_details", "model",
            "previous_response_id", "instructions", "output", "error", "tools", "tool_choice", "truncation",
            "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
            "temperature", "reasoning", "usage", "max_output_tokens", "max_tool_calls", "store", "background",
            "service_tier", "metadata", "safety_identifier", "prompt_cache_key"}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(EMBEDDED, "--max-context", "2048", "--api-key", KEY)
    try:
        yield proc
    finally:
        proc.stop()


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return server.request("POST", path, json=body, headers=AUTH, timeout=120)


def _events(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def _socket(server: ServerProcess) -> ClientConnection:
    return connect(server.url.replace("http://", "ws://") + "/v1/responses", additional_headers=AUTH,
                   open_timeout=30)


def _turn(ws: ClientConnection, body: dict[str, Any]) -> list[dict[str, Any]]:
    """One response.create and its events, up to the terminal or error event."""
    ws.send(json.dumps({"type": "response.create", **body}))
    events: list[dict[str, Any]] = []
    while True:
        events.append(json.loads(ws.recv(timeout=120)))
        if events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events


def test_the_response_object_has_every_required_field(server: ServerProcess) -> None:
    body = {**QUICK, "input": "hi", "temperature": 0.7, "tools": [WEATHER], "prompt_cache_key": "k",
            "safety_identifier": "u1", "max_tool_calls": 3}
    r = _post(server, "/v1/responses", body).json()
    assert REQUIRED <= r.keys()
    assert r["temperature"] == 0.7 and r["top_p"] == 1.0 and r["presence_penalty"] == 0.0
    assert isinstance(r["completed_at"], int) and r["completed_at"] >= r["created_at"]
    assert r["background"] is False and r["service_tier"] == "default" and r["max_tool_calls"] == 3
    assert r["prompt_cache_key"] == "k" and r["safety_identifier"] == "u1"
    assert r["tools"] == [{**WEATHER, "description": None, "strict": True}]
    assert r["usage"]["input_tokens"] > 0 and r["usage"]["output_tokens"] > 0
    events = _events(server, body)
    created = events[0]["response"]
    assert events[0]["type"] == "response.created" and REQUIRED <= created.keys()
    assert created["completed_at"] is None and created["usage"]["input_tokens"] == r["usage"]["input_tokens"]
    assert all(e["response"]["usage"] is not None for e in events if "response" in e)


def test_compact_endpoint(server: ServerProcess) -> None:
    convo = [{"type": "message", "role": "user", "content": "The launch is on Tuesday."},
             {"type": "message", "role": "assistant", "content": "Noted: Tuesday."}]
    missing = _post(server, "/v1/responses/compact", {"input": convo})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    r = _post(server, "/v1/responses/compact", {"model": "default", "input": convo, "max_output_tokens": 24})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "response.compaction" and out["usage"]["output_tokens"] > 0
    kinds = [(i["type"], i.get("role")) for i in out["output"]]
    assert kinds == [("message", "user"), ("compaction", None)]  # the user message kept, the rest summarised
    assert out["output"][0]["content"][0]["text"] == "The launch is on Tuesday."
    assert isinstance(out["output"][1]["encrypted_content"], str)
    follow = _post(server, "/v1/responses", {**QUICK, "input": [*out["output"], {"role": "user", "content": "?"}]})
    assert follow.status_code == 200 and follow.json()["status"] in ("completed", "incomplete")


def test_the_summary_budget_leaves_the_conversation_room() -> None:
    """The summary's max_tokens: 2,048, a quarter of a smaller context, or the request's own if smaller still."""
    from tandem.server.responses_compact import compaction_chat_body

    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}
    assert compaction_chat_body(chat, 262144)["max_tokens"] == 2048
    assert compaction_chat_body(chat, 384)["max_tokens"] == 96
    assert compaction_chat_body({**chat, "max_tokens": 40}, 384)["max_tokens"] == 40
    assert compaction_chat_body({**chat, "max_tokens": 4000}, 32768)["max_tokens"] == 2048
    body = compaction_chat_body(chat, 384)
    assert "tool_choice" not in body and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["messages"][-1]["role"] == "user" and len(body["messages"]) == 2


def test_compaction_trigger_answers_one_compaction_item(server: ServerProcess) -> None:
    body = {**QUICK, "max_output_tokens": 24, "store": False, "tools": [WEATHER], "tool_choice": "required",
            "input": [{"role": "user", "content": "Remember: the code is 41."},
                      {"role": "assistant", "content": "OK."}, {"type": "compaction_trigger"}]}
    events = _events(server, body)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["compaction"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert len(done) == 1 and done[0]["item"] == final["output"][0]
    assert not [e for e in events if e["type"].startswith(("response.output_text", "response.function_call"))]


def test_websocket_key_and_origin_are_checked_on_the_upgrade(server: ServerProcess) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                            ({**AUTH, "Origin": "http://evil.example"}, 403)):
        with pytest.raises(InvalidStatus) as info:
            connect(url, additional_headers=headers, open_timeout=30).close()
        assert info.value.response.status_code == status
        assert json.loads(info.value.response.body or b"{}")["error"]["message"]


def test_websocket_turns_continue_and_forget(server: ServerProcess) -> None:
    with _socket(server) as ws:
        first = _turn(ws, {**QUICK, "store": False, "input": "Remember the code word: cobalt."})
        assert [e["type"] for e in first][:2] == ["response.created", "response.in_progress"]
        assert first[-1]["type"] in ("response.completed", "response.incomplete")
        assert [e["sequence_number"] for e in first] == list(range(len(first)))
        rid = first[-1]["response"]["id"]
        second = _turn(ws, {**QUICK, "store": False, "previous_response_id": rid, "input": "The code word?"})
        assert second[-1]["type"] in ("response.completed", "response.incomplete")
        grown = second[-1]["response"]["usage"]["input_tokens"]
        assert grown > first[-1]["response"]["usage"]["input_tokens"]  # the first turn is in the prompt
        rid2 = second[-1]["response"]["id"]
        bad = _turn(ws, {**QUICK, "store": False, "previous_response_id": rid2,
                         "input": [{"type": "function_call_output", "call_id": "call_none", "output": "x"}]})
        assert bad[-1]["type"] == "error" and bad[-1]["status"] == 400
        retry = _turn(ws, {**QUICK, "store": False, "previous_response_id": rid2, "input": "again"})
        assert retry[-1]["error"]["code"] == "previous_response_not_found"  # the failed continuation forgot it
        nonsense = _turn(ws, {"type": "session.update"})
        assert nonsense[-1]["type"] == "error" and nonsense[-1]["error"]["param"] == "type"
        third = _turn(ws, {**QUICK, "store": False, "input": "A new chain."})
        assert third[-1]["type"] in ("response.completed", "response.incomplete")
    with _socket(server) as ws:  # a store:false response lives on its own socket only
        again = _turn(ws, {**QUICK, "store": False, "previous_response_id": third[-1]["response"]["id"],
                           "input": "x"})
        assert again[-1]["type"] == "error" and again[-1]["error"]["code"] == "previous_response_not_found"


def test_websocket_close_cancels_the_running_turn(server: ServerProcess) -> None:
    ws = _socket(server)
    ws.send(json.dumps({"type": "response.create", "model": "default", "input": "Write a long story.",
                        "max_output_tokens": 1500, "reasoning": {"effort": "none"}}))
    while json.loads(ws.recv(timeout=120))["type"] != "response.output_text.delta":
        pass
    ws.close()
    t0 = time.monotonic()
    r = _post(server, "/v1/responses", {**QUICK, "input": "hi"})  # served at once: the engine was freed
    assert r.status_code == 200 and time.monotonic() - t0 < 30
