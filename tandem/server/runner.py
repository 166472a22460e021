"""From a validated request to engine work: render and encode the prompt, build the grammar, run the choices."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from tandem.chat import ChatTemplateError
from tandem.engine import Engine, PromptTooLongError
from tandem.server.errors import APIError, invalid
from tandem.server.grammar import GrammarCompiler, GrammarConstraint, json_grammar, tool_call_grammar
from tandem.server.protocol import GenerationRequest
from tandem.server.scheduler import Job
from tandem.server.tool_parser import detect_form

_RESERVED_KWARGS = {"messages", "tools", "documents"}


@dataclass
class Plan:
    """Everything a request needs before it waits for the engine."""

    request: GenerationRequest
    prompt_ids: list[int]
    in_reasoning: bool
    tool_form: str | None  # "xml" / "json" when tool calls are parsed, else None
    matcher: llguidance.LLMatcher | None
    budget_tokens: int
    cached_tokens: int = 0  # prompt tokens the first choice restored from the prefix cache


def _render(engine: Engine, req: GenerationRequest) -> str:
    if engine.chat_template is None or engine.tokenizer is None:
        raise invalid("messages", "this model has no chat template; use /v1/completions")
    tools = req.tools if req.tool_choice != "none" else None
    kwargs = {k: v for k, v in req.chat_template_kwargs.items() if k not in _RESERVED_KWARGS}
    try:
        return engine.chat_template.render(req.messages or [], tools=tools, **kwargs)
    except (ChatTemplateError, TypeError, ValueError) as exc:
        raise invalid("messages", str(exc)) from exc


def make_plan(engine: Engine, compiler: Callable[[], GrammarCompiler], req: GenerationRequest) -> Plan:
    """Encode the prompt and compile the grammar. Raises APIError 400 (bad prompt, too long, bad schema)."""
    in_reasoning = False
    if req.kind == "chat":
        text = _render(engine, req)
        ids = engine.encode_prompt(text)
        in_reasoning = text.rfind("<think>") > text.rfind("</think>")
    else:
        try:
            ids = engine.encode_prompt(req.prompt if req.prompt is not None else "")
        except ValueError as exc:
            raise invalid("prompt", str(exc)) from exc
    if len(ids) >= engine.max_context:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context holds {engine.max_context} "
                            "(prompt + output)", param="messages" if req.kind == "chat" else "prompt",
                       code="context_length_exceeded")
    budget = min(req.max_tokens or engine.max_context, engine.max_context - len(ids))
    form = detect_form(engine.chat_template.source if engine.chat_template else None)
    parse_tools = req.kind == "chat" and bool(req.tools) and req.tool_choice != "none"
    matcher = None
    if req.response_format is not None:
        matcher = compiler().matcher(json_grammar(req.response_format["schema"]), "response_format")
    elif parse_tools and req.tool_choice != "auto":
        lark = tool_call_grammar(compiler(), req.tools or [], form, req.forced_function, req.parallel_tool_calls)
        matcher = compiler().matcher(lark, "tools")
    return Plan(req, ids, in_reasoning, form if parse_tools else None, matcher, budget)


def make_work(engine: Engine, compiler: Callable[[], GrammarCompiler], plan: Plan) -> Callable[[Job], None]:
    """The thread body: run each of the request's n choices, emitting ("chunk", (i, chunk, t)) and ("done", i)."""
    req = plan.request

    def work(job: Job) -> None:
        for i in range(req.n):
            seed = req.params.seed + i if req.params.seed is not None else None
            params = dataclasses.replace(req.params, seed=seed, max_tokens=plan.budget_tokens)
            constraint = None
            if plan.matcher is not None:
                think_end = engine.tokenizer.token_id("</think>") if engine.tokenizer is not None else None
                constraint = GrammarConstraint(
                    plan.matcher.deep_copy(), compiler(), in_reasoning=plan.in_reasoning, think_end_id=think_end,
                    budget_tokens=plan.budget_tokens, reserve_tokens=min(plan.budget_tokens // 2, 512))
            try:
                for chunk in engine.generate(plan.prompt_ids, params, cancelled=job.cancelled,
                                             constraint=constraint, cache_salt=req.cache_salt):
                    if i == 0:
                        plan.cached_tokens = engine.last_cached_tokens
                    job.emit("chunk", (i, chunk, time.perf_counter()))
            except PromptTooLongError as exc:
                raise APIError(400, str(exc), code="context_length_exceeded") from exc
            job.emit("done", i)
            if job.cancelled():
                return

    return work


def token_text(engine: Engine, token_id: int) -> str:
    """A token's own text (lossy for a token holding part of a UTF-8 character)."""
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else ""


def logprob_entry(engine: Engine, token_id: int, logprob: float) -> dict[str, Any]:
    """OpenAI's {token, logprob, bytes} for one token."""
    text = token_text(engine, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
