"""Forced tool calls hold while the model thinks: with tool_choice "required" or a named function, end-of-sequence
is not a legal token inside the reasoning, so the reasoning closes (by itself or at its budget) and the call follows,
over many seeds and temperatures, with speculation exactly as without. The embedded model, on the CPU. (The server
routes of the three APIs are tested in tests/test_clients_forced.py.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from spec_helpers import GarbageDrafter, OracleDrafter, speculating
from tandem.engine import Engine
from tandem.server.constraint import GrammarConstraint
from tandem.server.grammar import GrammarCompiler
from tandem.server.protocol import parse_chat
from tandem.server.responses import ChoiceOutput
from tandem.server.runner import Plan, make_plan

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]
# Prompts on which the embedded model, unconstrained, often ends its reasoning with eos after a few tokens.
PROMPTS = ("say hi", "Thanks!")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(None)


@pytest.fixture(scope="module")
def compiler(engine: Engine) -> GrammarCompiler:
    assert engine.tokenizer is not None
    return GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)


class Recording(GrammarConstraint):
    """The constraint, recording whether eos was allowed at each reasoning step."""

    eos_allowed_in_reasoning: list[bool]

    def allowed(self) -> Any:
        mask = super().allowed()
        if self.in_reasoning:
            allowed = mask is None or bool(mask[self.eos_token_ids].any())
            self.eos_allowed_in_reasoning.append(allowed and self.num_reasoning_tokens < self.reasoning_limit)
        return mask


def _plan(engine: Engine, compiler: GrammarCompiler, prompt: str, choice: Any, temperature: float, seed: int,
          max_tokens: int = 64) -> Plan:
    body = {"messages": [{"role": "user", "content": prompt}], "tools": WEATHER, "tool_choice": choice,
            "temperature": temperature, "seed": seed, "max_tokens": max_tokens}
    plan = make_plan(engine, lambda: compiler, parse_chat(body), None)
    assert plan.in_reasoning and plan.matcher is not None and plan.trigger_id is None
    return plan


def _constraint(engine: Engine, compiler: GrammarCompiler, plan: Plan) -> tuple[Recording, Any]:
    """The constraint of one choice as runner.make_work builds it, and the choice's sampling parameters."""
    assert engine.tokenizer is not None
    constraint = Recording(
        plan.matcher.deep_copy() if plan.matcher is not None else None, compiler, in_reasoning=plan.in_reasoning,
        think_end_id=engine.tokenizer.token_id("</think>"), budget_tokens=plan.budget_tokens,
        reserve_tokens=min(plan.budget_tokens // 2, 512), reasoning_budget=plan.reasoning_budget,
        trigger_id=plan.trigger_id, closers=plan.closers, close_tokens=plan.close_tokens)
    constraint.eos_allowed_in_reasoning = []
    return constraint, dataclasses.replace(plan.request.params, max_tokens=plan.budget_tokens)


def _run(engine: Engine, compiler: GrammarCompiler, plan: Plan) -> tuple[ChoiceOutput, Recording]:
    """One choice as runner.make_work runs it."""
    constraint, params = _constraint(engine, compiler, plan)
    output = ChoiceOutput(plan)
    for chunk in engine.generate(plan.prompt_ids, params, constraint=constraint):
        output.feed(chunk)
    return output, constraint


CHOICES = ("required", {"type": "function", "function": {"name": "get_weather"}})


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.4])
def test_a_forced_call_follows_the_reasoning_every_time(engine: Engine, compiler: GrammarCompiler, prompt: str,
                                                        temperature: float) -> None:
    for seed, choice in enumerate(CHOICES):  # ("Thanks!", 0.6, seed 1) ended with eos after 19 reasoning tokens
        output, constraint = _run(engine, compiler, _plan(engine, compiler, prompt, choice, temperature, seed))
        where = f"{prompt!r} T={temperature} seed={seed}"
        assert constraint.eos_allowed_in_reasoning and not any(constraint.eos_allowed_in_reasoning), where
        assert output.reasoning and output.finish_reason == "tool_calls", where
        assert [c.name for c in output.calls] == ["get_weather"], where


def test_speculation_keeps_the_plain_tokens_and_prunes_eos_guesses(engine: Engine, compiler: GrammarCompiler
                                                                    ) -> None:
    plan = _plan(engine, compiler, "Thanks!", "required", 0.6, 1)
    plain, _ = _run(engine, compiler, plan)
    eos = engine.eos_token_ids[0]

    def fresh() -> GrammarConstraint:
        c, _ = _constraint(engine, compiler, plan)
        return c

    con = fresh()
    assert con.valid_prefix([eos]) == 0  # a draft guessing eos inside the reasoning is pruned, never kept
    params = dataclasses.replace(plan.request.params, max_tokens=plan.budget_tokens)
    ids = engine.complete(plan.prompt_ids, params, constraint=fresh()).token_ids
    outputs = {tuple(plan.prompt_ids): ids}
    for drafter in (OracleDrafter(outputs, engine.vocab_size, depth=6, corrupt=0.2, siblings=2, seed=1),
                    GarbageDrafter(engine.vocab_size, num_nodes=8, seed=2)):
        spec = speculating(engine, [drafter])
        assert spec.complete(plan.prompt_ids, params, constraint=fresh()).token_ids == ids
    assert plain.calls and plain.finish_reason == "tool_calls"
