"""One request cannot take the server down: the bodies that crashed it (grammar compiler stack overflows) or
answered 500, sent to a real server on loopback, which must answer each with a 4xx in the route's error shape and
stay up (issue 53's cases)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from server_fixtures import ONE_THREAD, ServerProcess
from tandem.server.grammar_limits import MAX_SCHEMA_DEPTH

MSG = [{"role": "user", "content": "hi"}]
NO_THINK = {"enable_thinking": False}


@pytest.fixture(scope="module")
def server(served_model: Path) -> Iterator[ServerProcess]:
    model: Path = served_model
    proc = ServerProcess(model, "--max-context", "2048", env=ONE_THREAD)
    try:
        yield proc
    finally:
        proc.stop()


def ref_chain(n: int) -> dict[str, Any]:
    """The issue's crash schema: n object definitions, each one's property a $ref to the next."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}}
                            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def anyof_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]}
                            for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def deep_params(n: int) -> dict[str, Any]:
    """A tool's parameters whose property x is a chain of n $ref definitions."""
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": ref_chain(n)["$defs"]}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "b"\n'


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> Any:
    return server.request("POST", path, content=orjson.dumps(body), headers={"Content-Type": "application/json"})


def _openai_400(r: Any, param: str, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 4, "chat_template_kwargs": NO_THINK, **extra}


CRASH_CASES = [
    ("ref chain 1000", _chat(response_format={"type": "json_schema", "json_schema": {"schema": ref_chain(1000)}}),
     "response_format.json_schema.schema"),
    ("ref chain 170 (depth)", _chat(response_format={"type": "json_schema",
                                                     "json_schema": {"schema": ref_chain(170)}}),
     "response_format.json_schema.schema"),
    ("anyOf chain 3000", _chat(guided_json=anyof_chain(3000)), "guided_json"),
    ("lark chain 3000", _chat(guided_grammar=lark_chain(3000)), "guided_grammar"),
    ("lark chain 600", _chat(structured_outputs={"grammar": lark_chain(600)}), "structured_outputs.grammar"),
    ("lark embedding a ref chain", _chat(guided_grammar="start: %json " + orjson.dumps(ref_chain(300)).decode()),
     "guided_grammar"),
]


@pytest.mark.parametrize("name,body,param", CRASH_CASES, ids=[c[0] for c in CRASH_CASES])
def test_crash_bodies_are_400s(server: ServerProcess, name: str, body: dict[str, Any], param: str) -> None:
    err = _openai_400(_post(server, "/v1/chat/completions", body), param, "grammar_too_large")
    assert "MAX_" in err["message"] and param in err["message"]


def _tools(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_deep_tool_schema_is_400_on_chat(server: ServerProcess, choice: Any) -> None:
    body = _chat(tools=_tools(deep_params(400)), tool_choice=choice)
    _openai_400(_post(server, "/v1/chat/completions", body), "tools[0].function.parameters", "grammar_too_large")


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "f"}, {"type": "auto"}])
def test_deep_tool_schema_is_400_on_messages(server: ServerProcess, choice: Any) -> None:
    body = {"model": "m", "messages": MSG, "max_tokens": 4, "tool_choice": choice,
            "tools": [{"name": "f", "input_schema": deep_params(400)}]}
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]
    assert "tools[0].input_schema" in r.json()["error"]["message"]


def test_deep_schemas_are_400_on_responses(server: ServerProcess) -> None:
    body = {"input": "hi", "max_output_tokens": 16,
            "text": {"format": {"type": "json_schema", "name": "a", "schema": ref_chain(1000)}}}
    _openai_400(_post(server, "/v1/responses", body), "text.format.schema", "grammar_too_large")
    body = {"input": "hi", "max_output_tokens": 16, "tool_choice": "required",
            "tools": [{"type": "function", "name": "f", "parameters": deep_params(400)}]}
    _openai_400(_post(server, "/v1/responses", body), "tools[0].parameters", "grammar_too_large")


def test_largest_accepted_schema_compiles_and_answers(server: ServerProcess) -> None:
    """A $ref chain just under MAX_SCHEMA_DEPTH (3 levels a link) is served: the limit is not a refusal of
    ordinary deep schemas."""
    n = MAX_SCHEMA_DEPTH // 3 - 2
    body = _chat(response_format={"type": "json_schema", "json_schema": {"schema": ref_chain(n)}})
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_huge_guided_choice_is_400_naming_it(server: ServerProcess) -> None:
    err = _openai_400(_post(server, "/v1/chat/completions", _chat(guided_choice=[f"c{i}" for i in range(70_000)])),
                      "guided_choice", "grammar_too_large")
    assert "backtrace" not in err["message"] and "panic" not in err["message"]
    _openai_400(_post(server, "/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"enum": list(range(5000))}}})), "response_format.json_schema.schema", "grammar_too_large")


@pytest.mark.parametrize("name", ["ключ", "🔑", "a,b"])
@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "m", "messages": MSG, "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": MSG}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
    ("/v1/chat/completions", _chat(max_tokens=2)),
])
def test_non_latin1_unknown_field_is_ignored_not_500(server: ServerProcess, path: str, body: dict[str, Any],
                                                     name: str) -> None:
    r = _post(server, path, {**body, name: 1})
    assert r.status_code == 200, r.text[:300]
    shown = r.headers["X-Tandem-Ignored-Fields"]
    assert shown.isascii() and "\\" in shown


@pytest.mark.parametrize("kind", ["string", "array", "integer", "null"])
def test_non_object_tool_schema_is_400_on_every_api(server: ServerProcess, kind: str) -> None:
    schema = {"type": kind}
    _openai_400(_post(server, "/v1/chat/completions", _chat(tools=_tools(schema), tool_choice="required")),
                "tools[0].function.parameters.type")
    r = _post(server, "/v1/messages", {"model": "m", "messages": MSG, "max_tokens": 2, "tool_choice": {"type": "any"},
                                       "tools": [{"name": "f", "input_schema": schema}]})
    assert r.status_code == 400 and "'tools[0].input_schema' must" in r.json()["error"]["message"], r.text[:300]
    r = _post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 16, "tool_choice": "required",
                                        "tools": [{"type": "function", "name": "f", "parameters": schema}]})
    _openai_400(r, "tools[0].parameters.type")


@pytest.mark.parametrize("field", ["content", "summary"])
def test_reasoning_item_with_int_content_is_400(server: ServerProcess, field: str) -> None:
    body = {"input": [{"type": "reasoning", field: 5}, {"role": "user", "content": "hi"}], "max_output_tokens": 16}
    _openai_400(_post(server, "/v1/responses", body), "input[0]")


@pytest.mark.parametrize("kwargs,param", [({"add_generation_prompt": False},
                                           "chat_template_kwargs.add_generation_prompt"),
                                          ({"raise_exception": "x"}, "chat_template_kwargs.raise_exception")])
def test_server_template_variables_are_refused_without_internals(server: ServerProcess, kwargs: dict[str, Any],
                                                                 param: str) -> None:
    err = _openai_400(_post(server, "/v1/chat/completions", _chat(chat_template_kwargs=kwargs)), param)
    assert "render_segments" not in err["message"] and "callable" not in err["message"]


def test_template_type_errors_do_not_show_python(server: ServerProcess) -> None:
    r = _post(server, "/v1/chat/completions", _chat(chat_template_kwargs={"enable_thinking": {"a": 1}, "x": 1}))
    assert r.status_code in (200, 400)
    if r.status_code == 400:
        assert "object" not in r.json()["error"]["message"].split(":")[0]


def test_server_survived(server: ServerProcess) -> None:
    assert server.proc.poll() is None
    assert server.request("GET", "/health").json()["status"] == "ok"
    r = _post(server, "/v1/chat/completions", _chat(max_tokens=2))
    assert r.status_code == 200
    log = "".join(server.errors)
    assert "Traceback" not in log and "internal error" not in log, log[-2000:]
