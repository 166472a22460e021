"""Bounded work and 4xx-only validation without a server: stop matching, request caps, deep or odd values, tool
values that JSON cannot hold."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import orjson
import pytest

from tandem.output import StopMatcher
from tandem.sampling import MAX_STOP_CHARS, MAX_STOPS, SamplingParams, process_logits
from tandem.server.errors import MAX_QUOTE_CHARS, APIError
from tandem.server.protocol import (MAX_IGNORED_SHOWN, MAX_JSON_DEPTH, MIN_TOP_P, decode_body, parse_chat,
                                    parse_completion)
from tandem.server.tool_parser import ToolCallParser, convert_value

MSG = [{"role": "user", "content": "hi"}]


class _Reference:
    """The plain stop matcher the automaton must agree with: every find, every prefix checked at every push."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.pending = [s for s in stops if s], ""

    def push(self, text: str) -> tuple[str, bool]:
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return buf[:cut], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False


def test_stop_matcher_agrees_with_the_plain_search() -> None:
    rng = random.Random(7)
    for trial in range(3000):
        alpha = "ab" if trial % 2 else "abc"
        stops = ["".join(rng.choice(alpha) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
        ref, fast = _Reference(stops), StopMatcher(stops)
        for _ in range(rng.randint(1, 15)):
            piece = "".join(rng.choice(alpha) for _ in range(rng.randint(0, 5)))
            got = fast.push(piece)
            assert got == ref.push(piece) and fast.pending == ref.pending, (stops, piece)
            if got[1]:
                break


class _CountingStr(str):
    """A str that counts its item reads (the matcher's only per-character work on a stop string)."""

    reads = 0

    def __getitem__(self, key: Any) -> str:
        _CountingStr.reads += 1
        return super().__getitem__(key)


def test_stop_matching_is_linear_in_the_text() -> None:
    """Worst case for a prefix scan: stops of a's ending in b over a text of a's. Reads per pushed character stay
    a small constant per stop (KMP: at most two amortised), not the stop length."""
    stops = [_CountingStr("a" * (MAX_STOP_CHARS - 1) + "b") for _ in range(MAX_STOPS)]
    m = StopMatcher(stops)
    _CountingStr.reads = 0
    num_chars = 0
    for _ in range(2000):
        text, hit = m.push("aa")
        num_chars += 2
        assert not hit
    assert m.pending == "a" * (MAX_STOP_CHARS - 1)
    assert _CountingStr.reads <= 3 * num_chars * MAX_STOPS
    assert m.push("b") == ("", True)


def _bad(fn: Any, *args: Any, param: str | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert 400 <= info.value.status < 500
    assert len(info.value.message) <= 1001
    if param is not None:
        assert info.value.param == param, info.value.message
    return info.value


def test_caps_on_per_token_fields() -> None:
    _bad(parse_chat, {"messages": MSG, "stop": ["x"] * (MAX_STOPS + 1)}, param="stop")
    _bad(parse_chat, {"messages": MSG, "stop": "x" * (MAX_STOP_CHARS + 1)}, param="stop")
    assert parse_chat({"messages": MSG, "stop": ["x" * MAX_STOP_CHARS] * MAX_STOPS}).params.stop[0] == \
        "x" * MAX_STOP_CHARS
    _bad(parse_completion, {"prompt": "x", "stop_token_ids": list(range(5000))}, param="stop_token_ids")
    tool = {"type": "function", "function": {"name": "f"}}
    _bad(parse_chat, {"messages": MSG, "tools": [tool] * 129}, param="tools")
    _bad(parse_chat, {"messages": MSG, "logit_bias": {str(i): 1 for i in range(300)}}, param="logit_bias")
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["y" * 300]).validate()


def test_odd_roles_deep_values_and_long_values_are_400() -> None:
    _bad(parse_chat, {"messages": [{"role": ["user"], "content": "x"}]}, param="messages[0]")
    _bad(parse_chat, {"messages": [{"role": {"a": 1}, "content": "x"}]}, param="messages[0]")
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert "deeper" in _bad(decode_body, raw).message
    shallow: Any = 1
    for _ in range(MAX_JSON_DEPTH - 2):
        shallow = [shallow]
    body = decode_body(orjson.dumps({"messages": MSG, "temperature": shallow}))
    assert len(_bad(parse_chat, body, param="temperature").message) < 200
    err = _bad(parse_chat, {"messages": MSG, "temperature": "t" * 1_000_000}, param="temperature")
    assert len(err.message) < 200 and "…" in err.message
    err = _bad(parse_chat, {"messages": MSG, "k" * 100_000: 1}, True)
    assert "k" * (MAX_QUOTE_CHARS + 1) not in err.message and err.param is not None
    assert len(err.param) <= MAX_QUOTE_CHARS + 1
    # not strict: ignored, and named short, ASCII-safe and few (the warning and the response header show them)
    many = {"messages": MSG, "k" * 100_000: 1, "\u00e9t\u00e9": 2, **{f"x{i}": i for i in range(100)}}
    shown = parse_chat(many).ignored
    assert len(shown) == MAX_IGNORED_SHOWN + 1 and shown[-1] == "..."
    assert all(len(n) <= 4 * MAX_QUOTE_CHARS and n.isascii() and "," not in n for n in shown)


def test_tool_schemas_of_the_wrong_shape_are_400() -> None:
    def body(params: Any) -> dict[str, Any]:
        return {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}}}

    _bad(parse_chat, body({"type": "object", "properties": [1, 2]}), param="tools[0].function.parameters.properties")
    _bad(parse_chat, body({"type": "object", "properties": "x"}), param="tools[0].function.parameters.properties")
    _bad(parse_chat, body({"type": "object", "properties": {}, "required": "a"}),
         param="tools[0].function.parameters.required")
    _bad(parse_chat, body({"type": "object", "properties": {}, "required": [1]}),
         param="tools[0].function.parameters.required")
    assert parse_chat(body({"type": "object", "properties": {"a": {}}, "required": ["a"]})).tools


def test_tiny_temperatures_are_greedy() -> None:
    for t in (5e-324, 1e-38, 1e-6):
        assert parse_chat({"messages": MSG, "temperature": t}).params.temperature == 0.0
    assert parse_chat({"messages": MSG, "temperature": 1e-5}).params.temperature == 1e-5
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-38).validate()


def test_top_p_zero_keeps_the_most_likely_token_alone() -> None:
    for p in (0, 0.0, 1e-12):
        params = parse_chat({"messages": MSG, "temperature": 1, "top_p": p}).params
        assert params.top_p == MIN_TOP_P and params.validate() is params
    flat = np.zeros(200_000, dtype=np.float32)  # the flattest case: every id equally likely but the top one
    flat[7] = 1e-3
    assert np.isfinite(process_logits(flat, params, None)).nonzero()[0].tolist() == [7]
    assert parse_chat({"messages": MSG, "top_p": 0.5}).params.top_p == 0.5


@pytest.mark.parametrize("text", ["1j", "{1, 2}", "{1: 2}", "b'x'", "...", "1e999", "-1e999", "nan", "10**9",
                                  "99999999999999999999999999", str(10**30) + ".", "[1, {2}]", "{'a': 1j}",
                                  "[" * 5000 + "]" * 5000])
def test_tool_values_json_cannot_hold_stay_text(text: str) -> None:
    for schema in ({"type": "integer"}, {"type": "object"}, {}, None):
        value = convert_value(text, schema)
        assert value == text or orjson.loads(orjson.dumps(value)) == value  # raises nothing; a JSON value or text
    parser = ToolCallParser([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}}}}}])
    events = parser.push(f"<tool_call>\n<function=f>\n<parameter=a>\n{text}\n</parameter>\n</function>\n</tool_call>")
    events += parser.finish()
    calls = [v for k, v in events if k == "call"]
    assert len(calls) == 1
    assert orjson.loads(calls[0].arguments_json) == {"a": calls[0].arguments["a"]}
    assert calls[0].arguments["a"] is not None


def test_python_literals_that_are_json_values_still_convert() -> None:
    assert convert_value("(1, 2)", {"type": "array"}) == (1, 2)
    assert convert_value("{'a': [1, 2.5]}", {"type": "object"}) == {"a": [1, 2.5]}
    assert convert_value("12", {"type": "integer"}) == 12
