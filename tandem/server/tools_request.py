"""Validation of the chat fields that shape the output: tools, tool_choice, parallel_tool_calls, response_format,
and vLLM's structured outputs (`structured_outputs` {json, regex, choice, grammar}, `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`).

An output format is {"type", "schema"} (a JSON schema) or {"type", "lark"} (a Lark grammar for llguidance)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from tandem.server.errors import invalid, quote
from tandem.server.grammar_limits import check_choices

MAX_TOOLS = 128  # OpenAI's bound on the tools of one request


def _tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise invalid(where, f"'{where}' must be {{'type': 'function', 'function': {{...}}}}")
    name = fn.get("name")
    if not isinstance(name, str) or not name or any(c in name for c in "<>\n ="):
        raise invalid(f"{where}.function.name", f"'{where}.function.name' must be a plain non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"{where}.function.parameters", f"'{where}.function.parameters' must be a JSON schema object")
    if params.get("type", "object") != "object":  # OpenAI's rule too: a call's arguments are one JSON object
        raise invalid(f"{where}.function.parameters.type", f"'{where}.function.parameters' must be a JSON schema of "
                                                           f"type 'object', got type {quote(params.get('type'))}")
    props, required = params.get("properties"), params.get("required")
    if props is not None and not isinstance(props, dict):
        raise invalid(f"{where}.function.parameters.properties",
                      f"'{where}.function.parameters.properties' must be an object of JSON schemas")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise invalid(f"{where}.function.parameters.required",
                      f"'{where}.function.parameters.required' must be a list of property names")
    return {"type": "function", "function": {**fn, "parameters": params}}


def _choice(value: Any, names: set[str]) -> str | dict[str, Any]:
    if value is None:
        return "auto" if names else "none"
    if value in ("auto", "none", "required"):
        if value == "required" and not names:
            raise invalid("tool_choice", "tool_choice 'required' needs 'tools'")
        return str(value)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
                                     "{'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise invalid("tool_choice", f"tool_choice names function {quote(name)}, which is not in 'tools'")
    return {"type": "function", "function": {"name": name}}


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object", "schema": {"type": "object"}, "param": "response_format"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "'response_format.json_schema.schema' must be "
                                                                "a JSON schema object")
        return {"type": "json_schema", "schema": schema, "param": "response_format.json_schema.schema"}
    raise invalid("response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'")


def _regex_lark(regex: str) -> str:
    return "start: /" + regex.replace("/", "\\/") + "/\n"


def _guided(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """vLLM's structured-output fields as an output format (the first one set), or None."""
    so = body.get("structured_outputs")
    if so is not None and not isinstance(so, dict):
        raise invalid("structured_outputs", "'structured_outputs' must be an object")
    fields = {**{k: body.get(f"guided_{k}") for k in ("json", "regex", "choice", "grammar")},
              **{k: v for k, v in (so or {}).items() if v is not None}}
    name = "structured_outputs" if so else "guided_"

    def param(key: str) -> str:
        return f"structured_outputs.{key}" if so and key in so else f"guided_{key}"

    if fields.get("json") is not None:
        schema = fields["json"]
        if isinstance(schema, str):
            try:
                schema = orjson.loads(schema)
            except orjson.JSONDecodeError:
                schema = None
        if not isinstance(schema, dict):
            raise invalid(name + ("json" if name == "guided_" else ""), "the guided JSON schema must be an object")
        return {"type": "json_schema", "schema": schema, "param": param("json")}
    if isinstance(fields.get("regex"), str):
        return {"type": "regex", "lark": _regex_lark(fields["regex"]), "param": param("regex")}
    choice = fields.get("choice")
    if choice is not None:
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise invalid(name + ("choice" if name == "guided_" else ""), "the guided choice must be a list of strings")
        check_choices(choice, param("choice"))
        return {"type": "choice", "lark": "start: " + " | ".join(orjson.dumps(c).decode() for c in choice) + "\n",
                "param": param("choice")}
    if isinstance(fields.get("grammar"), str):
        return {"type": "grammar", "lark": fields["grammar"], "param": param("grammar")}
    return None


def parse_tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any], bool,
                                                 dict[str, Any] | None]:
    """(tools or None, tool_choice, parallel_tool_calls, response_format or None) of a chat body.

    Raises: APIError 400 naming the bad field.
    """
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise invalid("tools", "'tools' must be a list")
    if raw is not None and len(raw) > MAX_TOOLS:
        raise invalid("tools", f"'tools' may hold at most {MAX_TOOLS} functions")
    tools = [_tool(i, t) for i, t in enumerate(raw or [])] or None
    names = {t["function"]["name"] for t in tools or []}
    choice = _choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    fmt = _response_format(body.get("response_format")) or _guided(body)
    if fmt is not None and choice not in ("auto", "none"):
        raise invalid("response_format", "'response_format' cannot be combined with a forced tool_choice")
    return tools, choice, parallel, fmt
