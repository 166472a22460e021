"""Tool-call text -> OpenAI tool_calls, incrementally: the Qwen3.5 XML form and the JSON form of earlier Qwen.

XML form (spec/qwen3_5.md §11.2, vLLM's `Qwen3CoderToolParser`):
    <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>
String values are raw text (they may hold `</parameter>`, `<`, quotes, newlines); other values are JSON (or
Python literals) and are typed by the tool's JSON schema. JSON form: `<tool_call>\n{"name": ..., "arguments":
{...}}\n</tool_call>`.

A call is sent only once its block is complete and parses, so malformed text is never sent as a partial call: it
falls back to plain content. The same parser serves streaming and whole text, so streamed pieces concatenate to
the non-streamed result at any cut.
"""

from __future__ import annotations

import ast
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tandem.server.reasoning import _partial_suffix

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAM_OPEN = re.compile(r"\s*<parameter=([^>\n]+)>")
_PARAM_NEXT = re.compile(r"\s*(<parameter=|\Z)")


@dataclass
class ToolCall:
    """One parsed call: function name, arguments as a dict (in order) and its id."""

    name: str
    arguments: dict[str, Any]
    id: str

    @property
    def arguments_json(self) -> str:
        """The arguments as compact JSON text (what OpenAI's `function.arguments` holds)."""
        return orjson.dumps(self.arguments).decode()

    def argument_pieces(self) -> list[str]:
        """The arguments JSON cut into one piece per argument (streamed deltas); they join to arguments_json."""
        if not self.arguments:
            return ["{}"]
        pieces = []
        for i, (key, value) in enumerate(self.arguments.items()):
            head = "{" if i == 0 else ","
            pieces.append(head + orjson.dumps({key: value}).decode()[1:-1])
        pieces[-1] += "}"
        return pieces


def detect_form(template_source: str | None) -> str:
    """Which tool-call form a chat template teaches: "xml" (Qwen3.5 / Qwen3-Coder) or "json" (Hermes style)."""
    if template_source and "<function=" not in template_source and "<tool_call>" in template_source:
        return "json"
    return "xml"


def _types(schema: Mapping[str, Any] | None) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    found = {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)} if isinstance(kind, list) \
        else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found |= _types(sub)
    if not found and "enum" in schema:
        found = {"string"} if all(isinstance(v, str) for v in schema["enum"]) else set()
    return found


def convert_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """Type a raw parameter value by its JSON schema (strings stay raw; a value that does not parse stays text)."""
    types = _types(schema)
    if types == {"string"}:
        return text
    stripped = text.strip()
    if "null" in types and stripped in ("null", "None"):
        return None
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "string" in types:
        return text
    try:
        return orjson.loads(stripped)
    except orjson.JSONDecodeError:
        pass
    try:
        value = ast.literal_eval(stripped)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return value if json_safe(value) else text


_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # the integers orjson writes


def json_safe(value: Any, max_depth: int = 64) -> bool:
    """Whether orjson writes `value` as the same JSON value: None, bool, an int in the 64-bit range, a finite
    float, str, and lists / tuples / str-keyed dicts of those, at most `max_depth` deep. False for what Python's
    literals hold beyond JSON (complex, set, bytes, Ellipsis, non-str keys, inf / nan, huge ints). Iterative."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, (bool, str)):
            continue
        if isinstance(item, int):
            if not _INT_RANGE[0] <= item <= _INT_RANGE[1]:
                return False
        elif isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, (list, tuple, dict)) and depth < max_depth:
            if isinstance(item, dict):
                if not all(isinstance(k, str) for k in item):
                    return False
                item = item.values()
            stack.extend((v, depth + 1) for v in item)
        else:
            return False
    return True


class ToolCallParser:
    """Incremental parser: push text, get ("content", text) and ("call", ToolCall) events.

    Args:
        tools: the request's tools (OpenAI shape); calls to other names are malformed.
        form: "xml" or "json" (see `detect_form`).
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]], form: str = "xml") -> None:
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self.form = form
        self.buf = ""
        self.in_call = False
        self.after_call = False
        self.num_calls = 0

    def push(self, text: str) -> list[tuple[str, Any]]:
        """Add generated text; return the events it completes."""
        self.buf += text
        events: list[tuple[str, Any]] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple[str, Any]]:
        """End of generation: held text becomes content (an unclosed call is malformed)."""
        events = self.push("")
        rest, self.buf = self.buf, ""
        if rest and not (self.after_call and not self.in_call and not rest.strip()):
            events.append(("content", rest))
        return events

    def _step(self, events: list[tuple[str, Any]]) -> bool:
        """Consume what can be decided now; True when the buffer changed and another step may progress."""
        if self.in_call:
            return self._close_call(events)
        if self.after_call:
            head = self.buf.lstrip()
            if not head or CALL_START.startswith(head):
                return False  # whitespace between calls, or the start of the next call: wait
            if head.startswith(CALL_START):
                self.buf = head
            self.after_call = False
        start = self.buf.find(CALL_START)
        if start >= 0:
            if start:
                events.append(("content", self.buf[:start]))
            self.buf, self.in_call = self.buf[start:], True
            return True
        keep = _partial_suffix(self.buf, CALL_START)
        if len(self.buf) > keep:
            events.append(("content", self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _close_call(self, events: list[tuple[str, Any]]) -> bool:
        pos = self.buf.find(CALL_END)
        while pos >= 0:
            call = self.parse_block(self.buf[len(CALL_START):pos])
            end = pos + len(CALL_END)
            if call is not None:
                events.append(("call", call))
                self.buf, self.in_call, self.after_call = self.buf[end:], False, True
                self.num_calls += 1
                return True
            after = self.buf[end:].lstrip()
            if after.startswith(CALL_START):  # a new call opens: this block was malformed
                events.append(("content", self.buf[:end]))
                self.buf, self.in_call = self.buf[end:], False
                return True
            pos = self.buf.find(CALL_END, end)
        return False

    def parse_block(self, block: str) -> ToolCall | None:
        """The call inside one `<tool_call>` block, or None when it is malformed."""
        parsed = self._parse_xml(block) if self.form == "xml" else self._parse_json(block)
        if parsed is None or parsed[0] not in self.schemas:
            return None
        return ToolCall(parsed[0], parsed[1], f"call_{uuid.uuid4().hex[:24]}")

    def _parse_xml(self, block: str) -> tuple[str, dict[str, Any]] | None:
        m = _FUNCTION.fullmatch(block)
        if m is None:
            return None
        name, body = m.group(1).strip(), m.group(2)
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        pos = 0
        while body[pos:].strip():
            opened = _PARAM_OPEN.match(body, pos)
            if opened is None:
                return None
            key, value_start = opened.group(1).strip(), opened.end()
            close = body.find("</parameter>", value_start)
            while close >= 0 and not _PARAM_NEXT.match(body, close + len("</parameter>")):
                close = body.find("</parameter>", close + 1)
            if close < 0:
                return None
            raw = body[value_start:close]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[key] = convert_value(raw, props.get(key))
            pos = close + len("</parameter>")
        return name, args

    @staticmethod
    def _parse_json(block: str) -> tuple[str, dict[str, Any]] | None:
        try:
            obj = orjson.loads(block.strip())
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                return None
        return (obj["name"], args) if isinstance(args, dict) else None
