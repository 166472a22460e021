"""The thinking budget through the constraint: reasoning is closed with `</think>` after exactly N reasoning tokens,
min_tokens holds eos back, the closing phase ends a forced call inside the budget, and speculation (an oracle
drafter and a garbage one) gives the very tokens of plain decoding across the forced close."""

from __future__ import annotations

import json

import pytest

from spec_helpers import GarbageDrafter, OracleDrafter, speculating
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tandem.server.constraint import GrammarConstraint
from tandem.server.grammar import GrammarCompiler, closers, min_answer_tokens, tool_call_grammar
from tandem.server.tool_parser import ToolCallParser

TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "integer"}, "a": {"type": "array", "items": {"type": "integer"}}},
    "required": ["s", "n", "a"]}}}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(None)  # the embedded model


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    assert engine.tokenizer is not None
    return GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)


def _think_prompt(engine: Engine) -> list[int]:
    assert engine.chat_template is not None
    text = engine.chat_template.render([{"role": "user", "content": "def add(a, b):"}])
    assert text.endswith("<think>\n")
    return engine.encode_prompt(text)


def _budget(engine: Engine, compiler: GrammarCompiler, n: int, max_tokens: int, min_tokens: int = 0
            ) -> GrammarConstraint:
    assert engine.tokenizer is not None
    return GrammarConstraint(None, compiler, in_reasoning=True, think_end_id=engine.tokenizer.token_id("</think>"),
                             budget_tokens=max_tokens, reserve_tokens=0, reasoning_budget=n, min_tokens=min_tokens)


@pytest.mark.parametrize("n", [0, 3, 11])
def test_reasoning_closed_at_n_tokens(engine: Engine, compiler: GrammarCompiler, n: int) -> None:
    assert engine.tokenizer is not None
    end = engine.tokenizer.token_id("</think>")
    # precondition: left alone, the embedded model thinks longer than n tokens here (it closes after 15)
    alone = engine.complete(_think_prompt(engine), SamplingParams(temperature=0.0, max_tokens=n + 1)).token_ids
    assert end not in alone[:n + 1]
    params = SamplingParams(temperature=0.0, max_tokens=n + 12, ignore_eos=True)
    done = engine.complete(_think_prompt(engine), params, constraint=_budget(engine, compiler, n, n + 12))
    assert end not in done.token_ids[:n] and done.token_ids[n] == end
    assert len(done.token_ids) == n + 12  # the answer goes on after the close


def test_spec_equals_plain_across_the_forced_close(engine: Engine, compiler: GrammarCompiler) -> None:
    prompt = _think_prompt(engine)
    for temperature, seed in ((0.0, None), (1.0, 3)):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=40, ignore_eos=True)
        plain = engine.complete(prompt, params, constraint=_budget(engine, compiler, 9, 40)).token_ids
        for drafter in (OracleDrafter({tuple(prompt): plain}, engine.vocab_size, depth=6, siblings=2, seed=1),
                        GarbageDrafter(engine.vocab_size, num_nodes=8, seed=2)):
            spec = speculating(engine, [drafter])  # type: ignore[list-item]
            assert spec.complete(prompt, params, constraint=_budget(engine, compiler, 9, 40)).token_ids == plain


def test_min_tokens_holds_eos(engine: Engine, compiler: GrammarCompiler) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30)
    con = GrammarConstraint(None, compiler, in_reasoning=False, think_end_id=None, budget_tokens=30,
                            reserve_tokens=0, min_tokens=30)
    done = engine.complete(engine.encode_prompt("x = 1\n"), params, constraint=con)
    assert len(done.token_ids) == 30 and not set(done.token_ids) & set(engine.eos_token_ids)


@pytest.mark.parametrize("max_tokens", [60, 120])
def test_closing_phase_ends_a_forced_call(engine: Engine, compiler: GrammarCompiler, max_tokens: int) -> None:
    assert engine.tokenizer is not None
    matcher = compiler.matcher(tool_call_grammar(compiler, TOOL, "xml", "f", False), "tools")
    con = GrammarConstraint(matcher, compiler, in_reasoning=False, think_end_id=engine.tokenizer.token_id("</think>"),
                            budget_tokens=max_tokens, reserve_tokens=max_tokens // 2,
                            closers=closers(engine.tokenizer, "xml"),
                            close_tokens=min_answer_tokens(engine.tokenizer, TOOL, "xml", "f") + 8)
    done = engine.complete(engine.encode_prompt("call f"), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                           constraint=con)
    assert done.finish_reason == "stop", done.text
    parser = ToolCallParser(TOOL, "xml")
    calls = [v for k, v in parser.push(done.text) + parser.finish() if k == "call"]
    assert len(calls) == 1 and set(json.loads(calls[0].arguments_json)) == {"s", "n", "a"}


def test_auto_tool_choice_grammar_starts_at_the_trigger(engine: Engine, compiler: GrammarCompiler) -> None:
    assert engine.tokenizer is not None
    trigger = engine.tokenizer.token_id("<tool_call>")
    assert trigger is not None
    matcher = compiler.matcher(tool_call_grammar(compiler, TOOL, "xml", None, True), "tools")
    con = GrammarConstraint(matcher, compiler, in_reasoning=False, think_end_id=None, budget_tokens=200,
                            reserve_tokens=100, trigger_id=trigger)
    free = engine.encode_prompt("x = 1")
    assert con.valid_prefix(free + [trigger]) == len(free)  # guesses past the trigger are pruned, never kept
    for t in free:
        assert con.allowed() is None
        con.advance(t)
    con.advance(trigger)
    mask = con.allowed()
    newline = engine.tokenizer.encode("\n")
    assert mask is not None and mask.sum() == 1 and mask[newline[0]]  # the call's text is held from here on
