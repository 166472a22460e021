"""Tool-call parsing on recorded model texts (no model): typed values, awkward strings, several calls, calls after
reasoning, the JSON form, malformed text; streamed pieces at every cut equal the non-streamed parse."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tandem.server.reasoning import ReasoningSplitter
from tandem.server.tool_parser import ToolCallParser, convert_value, detect_form

TOOLS = [
    {"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object"}}, "options": {"type": "object"},
        "count": {"type": "integer"}, "ratio": {"type": "number"}, "force": {"type": "boolean"},
        "note": {"type": ["string", "null"]}, "code": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}},
]

TYPED = ("<tool_call>\n<function=plan>\n<parameter=items>\n[{\"id\": 1, \"tags\": [\"a\"]}, {\"id\": 2, \"tags\": []}]\n"
         "</parameter>\n<parameter=options>\n{\"deep\": {\"x\": null, \"y\": [1.5, false]}}\n</parameter>\n"
         "<parameter=count>\n3\n</parameter>\n<parameter=ratio>\n0.25\n</parameter>\n<parameter=force>\ntrue\n"
         "</parameter>\n<parameter=note>\nNone\n</parameter>\n<parameter=code>\n007\n</parameter>\n</function>\n"
         "</tool_call>")
TYPED_ARGS = {"items": [{"id": 1, "tags": ["a"]}, {"id": 2, "tags": []}], "options": {"deep": {"x": None,
              "y": [1.5, False]}}, "count": 3, "ratio": 0.25, "force": True, "note": None, "code": "007"}
AWKWARD_VALUE = "line1 </parameter> still inside\n<b>\"quoted\" \\back\\slash\n\ttab café 東京 🌍"
AWKWARD = ("Let me write it.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a <b>.txt\n</parameter>\n"
           f"<parameter=content>\n{AWKWARD_VALUE}\n</parameter>\n</function>\n</tool_call>")
TWO = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
       "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n</function>\n</tool_call>")
AFTER_THINK = "I should check the weather.\n</think>\n\n" + TWO.split("\n<tool_call>\n<function=get_weather>\n<p")[0]
JSON_FORM = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln \\"x\\""}}\n</tool_call>\n'
             '<tool_call>\n{"name": "write_file", "arguments": {"path": "p", "content": "a\\nb"}}\n</tool_call>')

CASES: list[tuple[str, str, bool, str, list[tuple[str, dict[str, Any]]], str]] = [
    # (id, text, in_reasoning, form, calls, content)
    ("typed", TYPED, False, "xml", [("plan", TYPED_ARGS)], ""),
    ("awkward", AWKWARD, False, "xml", [("write_file", {"path": "/tmp/a <b>.txt", "content": AWKWARD_VALUE})],
     "Let me write it.\n\n"),
    ("two", TWO, False, "xml", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "São Paulo"})], ""),
    ("after_think", AFTER_THINK, True, "xml", [("get_weather", {"city": "Paris"})], ""),
    ("json_form", JSON_FORM, False, "json", [("get_weather", {"city": 'Köln "x"'}),
                                             ("write_file", {"path": "p", "content": "a\nb"})], ""),
]


def run(text: str, pieces: list[str], in_reasoning: bool, form: str) -> tuple[str, str, list[tuple[str, str]]]:
    """The server's pipeline on text arriving in `pieces`: (reasoning, content, [(name, streamed args JSON)])."""
    splitter, parser = ReasoningSplitter(in_reasoning), ToolCallParser(TOOLS, form)
    reasoning, content, calls = [], [], []
    for k, piece in enumerate(pieces):
        r, c = splitter.push(piece)
        events = parser.push(c)
        if k == len(pieces) - 1:
            r2, c2 = splitter.finish()
            r += r2
            events += parser.push(c2) + parser.finish()
        reasoning.append(r)
        for kind, value in events:
            if kind == "call":
                calls.append((value.name, "".join(value.argument_pieces())))
            else:
                content.append(value)
    assert "".join(pieces) == text
    return "".join(reasoning), "".join(content), calls


def cuts(text: str, seed: int = 0) -> list[list[str]]:
    """Every single cut, then random cuts of several pieces (a round may commit several tokens)."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(seed)
    for _ in range(60):
        points = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(2, 30))))
        out.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    out.append(list(text))  # one character a round
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parse_and_stream_at_every_cut(case: tuple[str, str, bool, str, list[Any], str]) -> None:
    _, text, in_reasoning, form, calls, content = case
    reasoning, got_content, got_calls = run(text, [text], in_reasoning, form)
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    assert got_content == content
    for n, a in got_calls:  # the streamed pieces join to exactly the non-streamed JSON
        assert a == json.dumps(json.loads(a), ensure_ascii=False, separators=(",", ":"))
    for pieces in cuts(text):
        assert run(text, pieces, in_reasoning, form) == (reasoning, got_content, got_calls), pieces


def test_call_after_think_keeps_reasoning() -> None:
    reasoning, content, calls = run(AFTER_THINK, [AFTER_THINK], True, "xml")
    assert reasoning == "I should check the weather." and content == "" and len(calls) == 1


MALFORMED = [
    "<tool_call>\n<function=nope>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",  # unknown fn
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # unclosed param
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # cut off
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",  # bad JSON (xml form)
    "Sure <tool_call> oops </tool_call> done",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_falls_back_to_content(text: str) -> None:
    for pieces in cuts(text):
        reasoning, content, calls = run(text, pieces, False, "xml")
        assert calls == [] and content == text.lstrip()


def test_malformed_then_valid() -> None:
    text = "<tool_call>\n<function=nope>\n</function>\n</tool_call>\n" + TWO
    for pieces in cuts(text)[::7]:
        _, content, calls = run(text, pieces, False, "xml")
        assert content.startswith("<tool_call>\n<function=nope>") and [n for n, _ in calls] == ["get_weather"] * 2


def test_convert_value_and_form() -> None:
    assert convert_value("12", {"type": "integer"}) == 12
    assert convert_value("1e3", {"type": "number"}) == 1000.0
    assert convert_value("False", {"type": "boolean"}) is False
    assert convert_value("null", {"anyOf": [{"type": "object"}, {"type": "null"}]}) is None
    assert convert_value("{'a': (1, 2)}", {"type": "object"}) == {"a": (1, 2)}
    assert convert_value("not json", {"type": "integer"}) == "not json"
    assert convert_value("[1]", None) == [1]
    assert detect_form("... <tool_call>\n<function=x> ...") == "xml"
    assert detect_form('... <tool_call>\n{"name": ...') == "json"
