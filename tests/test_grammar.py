"""llguidance masks through the Engine's constraint hook: a random model still writes schema-valid JSON and valid
tool calls (both template forms), and reasoning is closed in time for the answer."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tandem.server.errors import APIError
from tandem.server.constraint import GrammarConstraint
from tandem.server.grammar import GrammarCompiler, json_grammar, tool_call_grammar
from tandem.server.reasoning import ReasoningSplitter
from tandem.server.tool_parser import ToolCallParser

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 500},
                                           "ok": {"type": "boolean"}, "s": {"type": "string", "maxLength": 6},
                                           "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 2}},
          "required": ["n", "ok", "s", "xs"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
    "q": {"type": "string", "maxLength": 8}, "k": {"type": "integer", "minimum": 1, "maximum": 9},
    "opts": {"type": "object", "properties": {"fast": {"type": "boolean"}}, "required": ["fast"],
             "additionalProperties": False}}, "required": ["q", "k", "opts"]}}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {
             "host": {"type": "string", "enum": ["a.b", "c.d"]}}, "required": ["host"]}}}]


@pytest.fixture(scope="module")
def engine(served_model: Path) -> Engine:
    return Engine.from_pretrained(served_model)


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    assert engine.tokenizer is not None
    return GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)


def _run(engine: Engine, compiler: GrammarCompiler, lark: str, prompt: str, seed: int, in_reasoning: bool = False,
         max_tokens: int = 150) -> tuple[str, str]:
    assert engine.tokenizer is not None
    constraint = GrammarConstraint(compiler.matcher(lark, "test"), compiler, in_reasoning=in_reasoning,
                                   think_end_id=engine.tokenizer.token_id("</think>"), budget_tokens=max_tokens,
                                   reserve_tokens=max_tokens // 2)
    done = engine.complete(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens),
                           constraint=constraint)
    return done.text, done.finish_reason


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_is_valid(engine: Engine, compiler: GrammarCompiler, seed: int) -> None:
    text, finish = _run(engine, compiler, json_grammar(SCHEMA), "x", seed)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("form", ["xml", "json"])
@pytest.mark.parametrize("only,parallel", [(None, True), ("lookup", False)])
def test_forced_tool_calls_are_valid(engine: Engine, compiler: GrammarCompiler, form: str, only: str | None,
                                     parallel: bool) -> None:
    lark = tool_call_grammar(compiler, TOOLS, form, only, parallel)
    for seed in range(3):
        text, finish = _run(engine, compiler, lark, "call", seed, max_tokens=200)
        assert finish == "stop", text
        parser = ToolCallParser(TOOLS, form)
        events = parser.push(text) + parser.finish()
        calls = [v for k, v in events if k == "call"]
        assert calls and all(not v.strip() for k, v in events if k == "content"), text
        assert parallel or len(calls) == 1
        for call in calls:
            assert only is None or call.name == only
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments_json), schema)


def test_reasoning_is_closed_in_time(engine: Engine, compiler: GrammarCompiler) -> None:
    assert engine.chat_template is not None
    prompt = engine.chat_template.render([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<think>\n")
    text, finish = _run(engine, compiler, json_grammar(SCHEMA), prompt, seed=5, in_reasoning=True, max_tokens=120)
    assert finish == "stop" and "</think>" in text
    splitter = ReasoningSplitter(True)
    r, c = splitter.push(text)
    r2, c2 = splitter.finish()
    jsonschema.validate(json.loads(c + c2), SCHEMA)


def test_bad_grammar_is_a_400(compiler: GrammarCompiler) -> None:
    with pytest.raises(APIError) as info:
        compiler.matcher(json_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
                         "response_format")
    assert info.value.status == 400 and info.value.param == "response_format"


def test_special_token_markers(compiler: GrammarCompiler) -> None:
    assert compiler.marker("<tool_call>").startswith("<[")
    assert compiler.marker("plain") == '"plain"'

