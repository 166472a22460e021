"""Fuzzed request bodies against a real server on loopback, over every POST route: every answer is a 2xx or a 4xx
in the route's error shape (never a 5xx, never Python or native internals in the message), and the server stays
up. The generators include the grammar compiler's crash shapes (long `$ref` / `anyOf` chains, long Lark rule
chains, huge choice lists) in every place a grammar comes from. Derandomized (a fixed seed) with a small budget,
so it is the same run in CI every time."""

from __future__ import annotations

import json

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_fixtures import ONE_THREAD, ServerProcess
from tandem.server.anthropic_request import MESSAGES_FIELDS
from tandem.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from tandem.server.responses_request import RESPONSES_FIELDS

# Minutes of HTTP validation: the compiled pass skips it (the compiled modules on its path are the engine's, which
# the engine tests cover there).
pytestmark = pytest.mark.slow
FUZZ = settings(derandomize=True, max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(served_model: Path) -> Iterator[ServerProcess]:
    model: Path = served_model
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


def _chain_schema(kind: str, n: int) -> dict[str, Any]:
    link = {"ref": lambda i: {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}},
            "anyof": lambda i: {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]}}[kind]
    defs: dict[str, Any] = {f"d{i}": link(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "b"\n'


_lengths = st.sampled_from([1, 20, 150, 171, 400, 1000, 3000])
chain_schemas = st.builds(_chain_schema, st.sampled_from(["ref", "anyof"]), _lengths)
lark_chains = st.builds(_lark_chain, _lengths)
choice_lists = st.integers(0, 80_000).map(lambda n: [f"c{i}" for i in range(n)])
_FIELD_VALUES.update({
    "response_format": _FIELD_VALUES["response_format"] | st.builds(
        lambda s: {"type": "json_schema", "json_schema": {"schema": s}}, chain_schemas),
    "guided_json": chain_schemas | json_values, "guided_grammar": lark_chains | json_values,
    "guided_choice": choice_lists | json_values,
    "structured_outputs": st.builds(lambda g: {"grammar": g}, lark_chains)
    | st.builds(lambda s: {"json": s}, chain_schemas) | json_values,
    "tools": _FIELD_VALUES["tools"] | st.builds(
        lambda s, t: [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": s["$defs"]} if t else s}}],
        chain_schemas, st.booleans()),
})
_MESSAGES_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(_message, min_size=1, max_size=3) | json_values,
    "tools": st.lists(st.fixed_dictionaries({"name": st.just("f") | json_values,
                                             "input_schema": chain_schemas | json_values}), max_size=2)
    | json_values,
    "tool_choice": st.sampled_from([{"type": "any"}, {"type": "tool", "name": "f"}, {"type": "auto"}]) | json_values,
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]) | json_values,
}
_RESPONSES_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "input": st.text(max_size=20) | st.lists(_message | st.fixed_dictionaries(
        {"type": st.sampled_from(["reasoning", "function_call", "function_call_output"]), "content": json_values,
         "summary": json_values, "name": json_values, "output": json_values}), max_size=3) | json_values,
    "text": st.builds(lambda s: {"format": {"type": "json_schema", "name": "a", "schema": s}}, chain_schemas)
    | json_values,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": st.just("f"),
                                             "parameters": chain_schemas | json_values}), max_size=2) | json_values,
}


# valid but long work: kept short on a shared CPU
_BOUNDS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 16, "n": 2}


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    for key, most in _BOUNDS.items():
        v = body.get(key)
        if (key in body and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v > most):
            body[key] = most
    return body


def _bodies(table: Any, base: dict[str, Any], values: dict[str, st.SearchStrategy[Any]] | None = None
            ) -> st.SearchStrategy[bytes]:
    names = sorted(table) + ["unknown_field", "x" * 200, "ключ", "🔑"]
    values = _FIELD_VALUES if values is None else values
    fields = st.dictionaries(st.sampled_from(names), st.none(), max_size=4).flatmap(
        lambda chosen: st.fixed_dictionaries({k: values.get(k, json_values) for k in chosen}))
    # the stdlib writer: it holds integers past 64 bits, which orjson.dumps refuses (the server reads them)
    limit = "max_output_tokens" if "max_output_tokens" in table else "max_tokens"
    bodies = fields.map(lambda extra: json.dumps(_bounded({**base, limit: 3, **extra})).encode())
    raw = st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b'{"messages": [' * 50,
                           orjson.dumps({**base, "temperature": _deep(200)}),
                           b'{"prompt": "x", "stop": ' + b"[" * 1100 + b"]" * 1100 + b"}",
                           orjson.dumps({**base, "stop": "x" * 100_000})])
    return st.one_of(bodies, bodies, bodies, raw)


_INTERNALS = ("Traceback", "object has no attribute", "got multiple values", "is not callable", "panicked",
              "backtrace", "internal error", "NoneType", "KeyError", "TypeError", "AttributeError")


def _check(server: ServerProcess, path: str, body: bytes) -> None:
    r = server.request("POST", path, content=body, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code < 500, (body[:300], r.text[:300])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert b"internal_error" not in r.content and b"api_error" not in r.content, r.text[-300:]
        if path.endswith("completions"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        return
    answer = r.json()
    if r.status_code >= 400:
        anthropic = path.startswith("/v1/messages")
        err = answer["error"]
        assert (answer["type"] == "error") if anthropic else ("param" in err and "code" in err), answer
        assert isinstance(err["message"], str) and not any(s in err["message"] for s in _INTERNALS), answer


@FUZZ
@given(body=_bodies(CHAT_FIELDS, {"messages": [{"role": "user", "content": "hi"}]}))
def test_fuzz_chat_completions(server: ServerProcess, body: bytes) -> None:
    _check(server, "/v1/chat/completions", body)


@FUZZ
@given(body=_bodies(COMPLETION_FIELDS, {"prompt": "hi"}))
def test_fuzz_completions(server: ServerProcess, body: bytes) -> None:
    _check(server, "/v1/completions", body)


SMALL_FUZZ = settings(FUZZ, max_examples=60)


@SMALL_FUZZ
@given(body=_bodies(MESSAGES_FIELDS, {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    _MESSAGES_VALUES))
def test_fuzz_messages(server: ServerProcess, body: bytes) -> None:
    _check(server, "/v1/messages", body)


@SMALL_FUZZ
@given(body=_bodies(MESSAGES_FIELDS - {"max_tokens"},
                    {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, _MESSAGES_VALUES))
def test_fuzz_count_tokens(server: ServerProcess, body: bytes) -> None:
    _check(server, "/v1/messages/count_tokens", body)


@SMALL_FUZZ
@given(body=_bodies(RESPONSES_FIELDS, {"input": "hi"}, _RESPONSES_VALUES))
def test_fuzz_responses(server: ServerProcess, body: bytes) -> None:
    _check(server, "/v1/responses", body)


def test_server_still_up_after_fuzzing(server: ServerProcess) -> None:
    assert server.request("GET", "/health").json()["status"] == "ok"
    r = server.request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    assert not any("Traceback" in line for line in server.errors), "".join(server.errors)[-2000:]
