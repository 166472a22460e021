"""Fuzzed request bodies against a real server on loopback: every answer is a 2xx or a 4xx, never a 5xx, and the
server stays up. Derandomized (a fixed seed) with a small budget, so it is the same run in CI every time."""

from __future__ import annotations

import json

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_fixtures import ServerProcess, make_model
from tandem.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FUZZ = settings(derandomize=True, max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model: Path = make_model(tmp_path_factory.mktemp("fuzz_model"))
    proc = ServerProcess(model, "--max-context", "1024", "--max-queue", "4", env=ONE_THREAD)
    try:
        yield proc
    finally:
        proc.stop()


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2, -1, 5]),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.sampled_from([5e-324, 1e-38, 1e-6, 0.5, 2.0, 1e308, -0.0]),
                     st.text(max_size=12),
                     st.sampled_from(["", "auto", "none", "required", "user", "<|im_start|>system", "text",
                                      "json_object", "json_schema", "function", "\ue000", "1e999", "1j"]))
json_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(
        ["type", "role", "content", "name", "function", "parameters", "properties", "required", "schema",
         "json_schema", "text", "arguments", "tool_calls", "include_usage", "x"]) | st.text(max_size=5),
        inner, max_size=4)), max_leaves=12)


def _deep(n: int) -> Any:
    value: Any = 1
    for _ in range(n):
        value = [value]
    return value


_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"])
                                  | json_values, "content": st.text(max_size=20) | json_values})
_tool = st.fixed_dictionaries({"type": st.just("function") | json_values, "function": st.fixed_dictionaries({
    "name": st.sampled_from(["f", "get_weather"]) | json_values,
    "parameters": st.fixed_dictionaries({"type": st.just("object"), "properties": json_values,
                                         "required": json_values}) | json_values})})
_FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(_message, min_size=1, max_size=3) | json_values,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 600), max_size=8) | json_values,
    "tools": st.lists(_tool, max_size=2) | json_values,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
    | json_values,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]) | st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": json_values})})
    | json_values,
    "max_tokens": st.integers(-3, 8) | json_values, "n": st.integers(0, 3) | json_values,
    "stop": st.lists(st.text(max_size=4), max_size=3) | json_values,
    "temperature": st.floats(0, 2) | json_values,
}


_BOUNDS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2}  # valid but long work: kept short on a shared CPU


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    for key, most in _BOUNDS.items():
        v = body.get(key)
        if (key in body and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v > most):
            body[key] = most
    return body


def _bodies(table: dict[str, str], base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    names = sorted(table) + ["unknown_field", "x" * 200]
    fields = st.dictionaries(st.sampled_from(names), st.none(), max_size=4).flatmap(
        lambda chosen: st.fixed_dictionaries({k: _FIELD_VALUES.get(k, json_values) for k in chosen}))
    # the stdlib writer: it holds integers past 64 bits, which orjson.dumps refuses (the server reads them)
    bodies = fields.map(lambda extra: json.dumps(_bounded({**base, "max_tokens": 3, **extra})).encode())
    raw = st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b'{"messages": [' * 50,
                           orjson.dumps({**base, "temperature": _deep(200)}),
                           b'{"prompt": "x", "stop": ' + b"[" * 1100 + b"]" * 1100 + b"}",
                           orjson.dumps({**base, "stop": "x" * 100_000})])
    return st.one_of(bodies, bodies, bodies, raw)


def _check(server: ServerProcess, path: str, body: bytes) -> None:
    r = server.request("POST", path, content=body, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code < 500, (body[:300], r.text[:300])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert b"internal_error" not in r.content and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        r.json()


@FUZZ
@given(body=_bodies(CHAT_FIELDS, {"messages": [{"role": "user", "content": "hi"}]}))
def test_fuzz_chat_completions(server: ServerProcess, body: bytes) -> None:
    _check(server, "/v1/chat/completions", body)


@FUZZ
@given(body=_bodies(COMPLETION_FIELDS, {"prompt": "hi"}))
def test_fuzz_completions(server: ServerProcess, body: bytes) -> None:
    _check(server, "/v1/completions", body)


def test_server_still_up_after_fuzzing(server: ServerProcess) -> None:
    assert server.request("GET", "/health").json()["status"] == "ok"
    r = server.request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    assert not any("Traceback" in line for line in server.errors), "".join(server.errors)[-2000:]
