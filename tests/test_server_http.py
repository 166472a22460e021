"""Raw HTTP cases against a real server process: errors, body limits, context, disconnects, queueing, draining."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import ServerProcess
from tandem.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS, HONOURED, NO_EFFECT, REFUSED

MSG = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def model_dir(served_model: Path) -> Path:
    return served_model


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir, "--max-queue", "8", "--queue-timeout", "30", "--max-context", "4096")
    try:
        yield proc
    finally:
        proc.stop()


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


def test_malformed_json_and_wrong_types(server: ServerProcess) -> None:
    _error(server.request("POST", "/v1/chat/completions", content=b'{"messages": [', 
                          headers={"content-type": "application/json"}), 400)
    _error(server.request("POST", "/v1/chat/completions", content=b"[1, 2]", headers=JSON), 400)
    cases = [({"messages": MSG, "temperature": "hot"}, "temperature"), ({"messages": MSG, "max_tokens": -5},
             "max_tokens"), ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
             ({"messages": MSG, "n": "2"}, "n"), ({"messages": MSG, "stream": "yes"}, "stream"),
             ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
             ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
             ({"messages": MSG, "stop": [1]}, "stop"), ({"messages": MSG, "top_p": -0.1}, "top_p"),
             ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0]"),
             ({"messages": MSG, "tool_choice": "required"}, "tool_choice")]
    for body, param in cases:
        _error(server.request("POST", "/v1/chat/completions", json=body), 400, param)
    _error(server.request("POST", "/v1/completions", json={"prompt": 7}), 400, "prompt")
    _error(server.request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")


def test_unknown_model_and_route(server: ServerProcess) -> None:
    _error(server.request("POST", "/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}), 404, "model")
    _error(server.request("GET", "/v1/nothing"), 404)
    _error(server.request("GET", "/v1/chat/completions"), 405)


def test_body_too_large(server: ServerProcess) -> None:
    body = b'{"messages": [{"role": "user", "content": "' + b"a" * (10 * 1024 * 1024) + b'"}]}'
    _error(server.request("POST", "/v1/chat/completions", content=body, headers=JSON), 413)


def test_prompt_over_context(server: ServerProcess) -> None:
    long = " ".join(["weather"] * 6000)  # at least one token per word
    err = _error(server.request("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}),
                 400, "messages")
    assert err["code"] == "context_length_exceeded"
    _error(server.request("POST", "/v1/completions", json={"prompt": long}), 400, "prompt")


def test_field_table(server: ServerProcess) -> None:
    """The table of request fields is pinned: honoured, accepted with no effect, or refused with a 400; a field
    outside the table is ignored with a warning header (a 400 naming it under --strict-fields:
    tests/test_clients_edges.py)."""
    assert {k for k, v in CHAT_FIELDS.items() if v == NO_EFFECT} == {
        "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "reasoning_effort",
        "verbosity", "skip_special_tokens", "spaces_between_special_tokens"}
    assert {k for k, v in CHAT_FIELDS.items() if v == REFUSED} == {
        "logit_bias", "functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
        "chat_template"}
    assert {k for k, v in COMPLETION_FIELDS.items() if v == REFUSED} == {"logit_bias", "echo", "suffix", "best_of"}
    assert {k for k, v in CHAT_FIELDS.items() if v == HONOURED} >= {
        "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "n", "logprobs",
        "top_logprobs", "stream", "stream_options", "tools", "tool_choice", "response_format",
        "chat_template_kwargs"}
    base = {"messages": MSG, "max_tokens": 2}
    refused = {"logit_bias": {"5": 10}, "functions": [{"name": "f"}], "audio": {"voice": "x"},
               "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}}
    for name, value in refused.items():
        _error(server.request("POST", "/v1/chat/completions", json={**base, name: value}), 400, name)
    r = server.request("POST", "/v1/chat/completions", json={**base, "some_future_field": {"x": 1}})
    assert r.status_code == 200 and r.headers["x-tandem-ignored-fields"] == "some_future_field"  # never silent
    r = server.request("POST", "/v1/completions", json={"prompt": "x", "frobnicate": True, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-tandem-ignored-fields"] == "frobnicate"
    ok = {**base, "user": "u1", "metadata": {"a": "b"}, "store": False, "logit_bias": {}, "modalities": ["text"],
          "presence_penalty": 0.5, "frequency_penalty": 0.5,
          "repetition_penalty": 1.1, "top_k": 5, "min_p": 0.05, "max_completion_tokens": 2,
          "messages": [{"role": "developer", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    r = server.request("POST", "/v1/chat/completions", json=ok)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    _error(server.request("POST", "/v1/completions", json={"prompt": "x", "echo": True}), 400, "echo")


def test_disconnect_mid_stream_frees_engine(server: ServerProcess) -> None:
    body = {"messages": MSG, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = 0
            for _ in r.iter_lines():
                lines += 1
                if lines > 6:
                    break
    t0 = time.monotonic()
    r2 = server.request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True},
                        timeout=20)
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 3
    assert time.monotonic() - t0 < 2.5  # the 3000-token request (6+ s) was cancelled, not awaited
    health = server.request("GET", "/health").json()
    assert health["running"] == 0 and health["waiting"] == 0


def test_concurrent_requests_with_bounded_queue(server: ServerProcess) -> None:
    body = {"prompt": "the", "max_tokens": 60, "ignore_eos": True}

    def one(_: int) -> tuple[int, Any, dict[str, str]]:
        r = server.request("POST", "/v1/completions", json=body, timeout=60)
        return r.status_code, r.json(), dict(r.headers)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20), timeout=90))
    ok = [b for s, b, _ in results if s == 200]
    busy = [(b, h) for s, b, h in results if s == 503]
    assert len(ok) + len(busy) == 20
    assert len(ok) >= 9  # one running + eight waiting
    assert all(b["usage"]["completion_tokens"] == 60 and b["choices"][0]["finish_reason"] == "length" for b in ok)
    assert all("retry-after" in h and b["error"]["code"] == "queue_full" for b, h in busy)
    health = server.request("GET", "/health").json()
    assert health["running"] == 0 and health["waiting"] == 0
    assert server.request("POST", "/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_sigterm_drains(model_dir: Path) -> None:
    proc = ServerProcess(model_dir, "--max-context", "1024")
    try:
        body = {"prompt": "x", "max_tokens": 700, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", proc.url + "/v1/completions", json=body) as r:
            it = r.iter_lines()
            next(it)
            proc.terminate()
            time.sleep(0.3)
            health = proc.request("GET", "/health", timeout=5)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = proc.request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
            assert refused.status_code == 503 and "retry-after" in refused.headers
            rest = list(it)
        assert rest[-2] == "data: [DONE]"
        assert proc.proc.wait(20) == 0
    finally:
        proc.stop()
