"""From a validated request to engine work: render and encode the prompt, build the grammar, run the choices."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import llguidance

from tandem.chat import ChatTemplateError, render_segments
from tandem.engine import Engine, PromptTooLongError
from tandem.images import PreparedImage
from tandem.multimodal import collect_images, expand_pads, image_spec_of, prepare_images
from tandem.server.errors import APIError, invalid
from tandem.server.constraint import GrammarConstraint
from tandem.server.grammar_limits import check_lark, check_schema, format_param
from tandem.server.grammar import (GrammarCompiler, closers, json_grammar, min_answer_tokens,
                                   tool_call_grammar)
from tandem.server.protocol import GenerationRequest
from tandem.server.scheduler import Job
from tandem.server.tool_parser import detect_form

_RESERVED_KWARGS = {"messages", "tools", "documents"}  # the conversation's own fields: dropped from kwargs
# set by the server or the template's environment: a request may not replace them through chat_template_kwargs
_SERVER_KWARGS = {"add_generation_prompt", "raise_exception", "strftime_now"}


@dataclass
class Plan:
    """Everything a request needs before it waits for the engine."""

    request: GenerationRequest
    prompt_ids: list[int]
    in_reasoning: bool
    tool_form: str | None  # "xml" / "json" when tool calls are parsed, else None
    matcher: llguidance.LLMatcher | None
    budget_tokens: int
    reasoning_budget: int | None = None
    trigger_id: int | None = None  # tool_choice "auto": the grammar holds a call from this token on
    closers: list[list[int]] = dataclasses.field(default_factory=list)
    inline_reasoning: bool = False  # --reasoning-format content: reasoning stays in the content
    close_tokens: int = 0  # the closing phase: this many tokens before the budget ends (a grammar's answer)

    def needs_constraint(self) -> bool:
        """A grammar, a thinking budget inside open reasoning, or min_tokens."""
        return self.matcher is not None or (self.reasoning_budget is not None and self.in_reasoning) \
            or self.request.min_tokens > 0
    cached_tokens: int = 0  # prompt tokens the first choice restored from the prefix cache
    images: list[PreparedImage] = dataclasses.field(default_factory=list)  # the prompt's, pads expanded in ids
    slot: int | None = None  # the engine slot the first choice ran in (tandem/slots.py)
    cache_tier: str = ""  # the slowest cache tier the first choice's prompt was restored from ("": none)


def _encode_chat(engine: Engine, req: GenerationRequest) -> tuple[str, list[int], list[PreparedImage]]:
    """The rendered prompt, its ids and its images; control tokens only where the template writes them
    (chat.render_segments: a special-token string inside a message, tool or template variable is encoded as text);
    each image's pad expanded to its feature count (tandem/multimodal.py)."""
    if engine.chat_template is None or engine.tokenizer is None:
        raise invalid("messages", "this model has no chat template; use /v1/completions")
    tok = engine.tokenizer
    tools = req.tools if req.tool_choice != "none" else None
    kwargs = {k: v for k, v in req.chat_template_kwargs.items() if k not in _RESERVED_KWARGS}
    for name in sorted(_SERVER_KWARGS & kwargs.keys()):
        hint = " (send the request field add_generation_prompt)" if name == "add_generation_prompt" else ""
        raise invalid(f"chat_template_kwargs.{name}", f"'chat_template_kwargs.{name}' is set by the server{hint}")
    messages, parts = collect_images(req.messages or [])
    cont = req.continue_final_message and bool(messages) and messages[-1].get("role") == "assistant"
    try:
        segments = render_segments(engine.chat_template, messages, tok.special_token_strings(), tools=tools,
                                   add_generation_prompt=req.add_generation_prompt and not cont, **kwargs)
    except ChatTemplateError as exc:  # the template's own message (raise_exception) or jinja's
        raise invalid("messages", str(exc)) from exc
    except (TypeError, ValueError, AttributeError, RecursionError) as exc:  # the text would show Python internals
        raise invalid("messages", "the chat template cannot render this conversation: a message, tool or "
                                  "chat_template_kwargs value has a type the template does not take") from exc
    if cont:  # cut the rendered prompt right after the final message's text, so the reply continues it
        last = messages[-1].get("content")
        segments = _cut_after(segments, (last if isinstance(last, str) else "").strip())  # templates may trim it
    check_prompt_bytes(engine, sum(len(text.encode("utf-8", "surrogatepass")) for text, _ in segments), "messages")
    ids = [t for text, user in segments for t in (tok.encode_as_text(text) if user else tok.encode(text))]
    if not ids:
        raise invalid("messages", "the prompt is empty")
    images: list[PreparedImage] = []
    if parts:
        try:
            spec, pad = image_spec_of(engine.model)
            # no fetcher: the routes fetch image URLs before this (server/image_urls.py), never in a prep thread
            images = prepare_images(parts, spec, engine.image_limits)
            ids = expand_pads(ids, images, pad)
        except ValueError as exc:  # ImageError: a bad image, too many, a model that reads none
            raise invalid("messages", str(exc)) from exc
    return "".join(text for text, _ in segments), ids, images


def _cut_after(segments: list[tuple[str, bool]], last: str) -> list[tuple[str, bool]]:
    """The rendered segments cut right after the last occurrence of ``last`` in their joined text.
    Raises APIError 400 when it does not occur (continue_final_message cannot continue it)."""
    text = "".join(t for t, _ in segments)
    at = text.rfind(last) if last else -1
    if at < 0:
        raise invalid("continue_final_message", "the final assistant message is not in the rendered prompt")
    end, pos, out = at + len(last), 0, []
    for t, user in segments:
        if pos >= end:
            break
        out.append((t[:end - pos], user))
        pos += len(t)
    return out


def _too_long(engine: Engine, num_tokens: int, param: str) -> NoReturn:
    raise APIError(400, f"the prompt has {num_tokens} tokens; this model's context holds {engine.max_context} "
                        "(prompt + output)", param=param, code="context_length_exceeded")


def check_prompt_bytes(engine: Engine, num_bytes: int, param: str) -> None:
    """Refuse, before tokenizing, a prompt of `num_bytes` UTF-8 bytes that cannot fit the context: it needs at
    least num_bytes / max_token_bytes tokens (Tokenizer.max_token_bytes). Raises APIError 400
    context_length_exceeded naming `param`."""
    if engine.tokenizer is None:
        return
    per_token = engine.tokenizer.max_token_bytes
    if num_bytes >= engine.max_context * per_token:
        raise APIError(400, f"the prompt has {num_bytes} bytes, so at least {num_bytes // per_token} tokens (a "
                            f"token holds at most {per_token} bytes); this model's context holds "
                            f"{engine.max_context} (prompt + output)", param=param, code="context_length_exceeded")


def render_prompt(engine: Engine, req: GenerationRequest) -> list[int]:
    """The prompt token ids of a chat request (no grammar built). Raises APIError 400 (bad conversation)."""
    return _encode_chat(engine, req)[1]


def check_grammars(req: GenerationRequest) -> None:
    """Every schema and grammar the request would compile, against grammar_limits' bounds (APIError 400)."""
    fmt = req.response_format
    if fmt is not None:
        param = format_param(fmt, "response_format")
        if "lark" in fmt:
            check_lark(fmt["lark"], param)
        else:
            check_schema(fmt["schema"], param)
    if req.kind == "chat" and req.tools and req.tool_choice != "none":
        for i, tool in enumerate(req.tools):
            check_schema(tool["function"].get("parameters"), f"tools[{i}].function.parameters")


def make_plan(engine: Engine, compiler: Callable[[], GrammarCompiler], req: GenerationRequest,
              reasoning_budget: int | None = None) -> Plan:
    """Encode the prompt and compile the grammar. ``reasoning_budget``: the server's thinking budget (the request's
    `thinking_token_budget` wins). Raises APIError 400 (bad prompt, too long, bad schema)."""
    check_grammars(req)  # cheap, and before the prompt is tokenized: a refused grammar costs no tokenizing
    in_reasoning = False
    images: list[PreparedImage] = []
    if req.kind == "chat":
        text, ids, images = _encode_chat(engine, req)
        in_reasoning = text.rfind("<think>") > text.rfind("</think>")
    else:
        if isinstance(req.prompt, list) and len(req.prompt) >= engine.max_context:
            _too_long(engine, len(req.prompt), "prompt")
        if isinstance(req.prompt, str):
            check_prompt_bytes(engine, len(req.prompt.encode("utf-8", "surrogatepass")), "prompt")
        try:
            ids = engine.encode_prompt(req.prompt if req.prompt is not None else "")
        except ValueError as exc:
            raise invalid("prompt", str(exc)) from exc
    if len(ids) >= engine.max_context:  # before any grammar is compiled
        _too_long(engine, len(ids), "messages" if req.kind == "chat" else "prompt")
    budget = min(req.max_tokens or engine.max_context, engine.max_context - len(ids))
    form = detect_form(engine.chat_template.source if engine.chat_template else None)
    parse_tools = req.kind == "chat" and bool(req.tools) and req.tool_choice != "none"
    matcher, trigger, ends, close = None, None, [], 0
    if req.response_format is not None:
        fmt = req.response_format
        param = format_param(fmt, "response_format")
        lark = fmt["lark"] if "lark" in fmt else json_grammar(fmt["schema"])
        matcher = compiler().matcher(lark, param)
        ends = closers(compiler().tokenizer, None)
        close = min_answer_tokens(compiler().tokenizer, None, None, None, fmt.get("schema") or {})
    elif parse_tools:
        # A named tool is exactly one call; "required" and "auto" may hold more when parallel_tool_calls allows.
        parallel = req.parallel_tool_calls and req.forced_function is None
        lark = tool_call_grammar(compiler(), req.tools or [], form, req.forced_function, parallel)
        matcher = compiler().matcher(lark, "tools")
        ends = closers(compiler().tokenizer, form)
        close = min_answer_tokens(compiler().tokenizer, req.tools, form, req.forced_function)
        if req.tool_choice == "auto":
            trigger = engine.tokenizer.token_id("<tool_call>") if engine.tokenizer is not None else None
            matcher = matcher if trigger is not None else None
    think = req.thinking_token_budget if req.thinking_token_budget is not None else reasoning_budget
    return Plan(req, ids, in_reasoning, form if parse_tools else None, matcher, budget, think, trigger, ends,
                close_tokens=min(budget // 2, close + 8), images=images)


def make_work(engine: Engine, compiler: Callable[[], GrammarCompiler], plan: Plan) -> Callable[[Job], None]:
    """The thread body: run each of the request's n choices, emitting ("chunk", (i, chunk, t)) and ("done", i)."""
    req = plan.request

    def work(job: Job) -> None:
        for i in range(req.n):
            seed = req.params.seed + i if req.params.seed is not None else None
            params = dataclasses.replace(req.params, seed=seed, max_tokens=plan.budget_tokens)
            constraint = None
            if plan.needs_constraint():
                think_end = engine.tokenizer.token_id("</think>") if engine.tokenizer is not None else None
                constraint = GrammarConstraint(
                    plan.matcher.deep_copy() if plan.matcher is not None else None, compiler(),
                    in_reasoning=plan.in_reasoning, think_end_id=think_end, budget_tokens=plan.budget_tokens,
                    reserve_tokens=min(plan.budget_tokens // 2, 512), reasoning_budget=plan.reasoning_budget,
                    min_tokens=req.min_tokens, trigger_id=plan.trigger_id, closers=plan.closers,
                    close_tokens=plan.close_tokens)
            try:
                for chunk in engine.generate(plan.prompt_ids, params, cancelled=job.cancelled,
                                             constraint=constraint, cache_salt=req.cache_salt,
                                             images=plan.images):
                    if i == 0:
                        plan.cached_tokens, plan.slot = engine.last_cached_tokens, engine.last_slot
                        plan.cache_tier = engine.last_cache_tier
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
