"""Each route's own API decides what is valid on it: the ranges and enums of its sampling and limit fields.

The rules come from the official Python SDKs' request types (openai 3.63: `openai/types/chat/
completion_create_params.py`, `openai/types/completion_create_params.py`, `openai/types/responses/
response_create_params.py`; anthropic 2.17: `anthropic/types/message_create_params.py`, `message_count_tokens_
params.py`, `tool_choice_*_param.py`) and the API references they quote. anthropic 2.x no longer types
`temperature`, `top_p` and `top_k` (clients send them in `extra_body`); their ranges are the Messages API
reference's, which the 0.x SDKs quoted ("Ranges from 0.0 to 1.0"). A value the route's API forbids answers
400 naming the field, in the route's error shape, before the body is translated to the shared chat pipeline, so
no route takes a value under another API's rules (Anthropic's temperature stops at 1 though chat's goes to 2).
null stands for an absent field everywhere (the SDKs send Optional fields as null).

/v1/chat/completions (OpenAI Chat Completions):
    temperature 0..2; top_p 0..1; presence_penalty, frequency_penalty -2..2; top_logprobs 0..20 (needs logprobs);
    max_tokens, max_completion_tokens >= 1; n >= 1; stop a string or a list of strings; reasoning_effort in
    {none, minimal, low, medium, high, xhigh, max}; verbosity in {low, medium, high}; service_tier in
    {auto, default, flex, scale, priority, fast}.
/v1/completions (OpenAI legacy Completions):
    the same ranges; logprobs 0..5 ("The maximum value for logprobs is 5"); service_tier as above.
/v1/messages and /v1/messages/count_tokens (Anthropic Messages):
    model required (a non-empty string; any name is served); temperature 0..1; top_p 0..1; top_k an integer
    >= 0; max_tokens required (not on count_tokens) and >= 1; stop_sequences a list of strings (a bare string
    is refused, not wrapped); tool_choice an object of type auto / any / tool (with a name) / none; thinking
    {type: enabled, budget_tokens} with budget_tokens required, an integer >= 1024 and < max_tokens (the API's
    "max_tokens must be greater than thinking.budget_tokens"; with the `interleaved-thinking-2025-05-14` beta
    the budget spans a turn's thinking blocks and may exceed max_tokens, as the API allows), {type: adaptive}
    or {type: disabled}; service_tier in {auto, standard_only}; metadata an object; stream a boolean.
    count_tokens (`message_count_tokens_params.py`) defines model, messages, system, tools, tool_choice and
    thinking (model required, the budget >= 1024); the sampling fields it does not define are accepted, as
    before, under the Messages ranges.
/v1/responses (OpenAI Responses):
    temperature 0..2; top_p 0..1; max_output_tokens >= 16; top_logprobs 0..20; truncation in {auto, disabled};
    tool_choice none / auto / required or an object with a type ({type: function} needs a name);
    service_tier as chat's; parallel_tool_calls a boolean; max_tool_calls an integer >= 1.

Looser than the references, on purpose: every route takes up to MAX_STOPS (16) stop strings: OpenAI's reference says "up to 4 sequences", but its SDK types
bound no count and vLLM and llama-server take any number, so clients written for them pass; 16 bounds the work
at every token, and more is a 400 naming `stop` (`stop_sequences` on /v1/messages). top_p 0, inside every
route's range, keeps the most likely token alone (protocol.py maps it to MIN_TOP_P; llama.cpp keeps its one
min_keep token, vLLM refuses 0). The OpenAI routes take a body without `model`, as vLLM and llama-server do
(OpenAI's SDK types require it, and always send it). Anthropic's API refuses thinking beside a temperature or
top_k other than the default, a top_p under 0.95 or a forced tool (its models' limits); here they combine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tandem.server.errors import invalid, quote

_REASONING_EFFORT = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_VERBOSITY = ("low", "medium", "high")
_OPENAI_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
_ANTHROPIC_TIERS = ("auto", "standard_only")
_TRUNCATION = ("auto", "disabled")
_RESPONSES_CHOICES = ("none", "auto", "required")
_ANTHROPIC_CHOICES = ("auto", "any", "tool", "none")
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise invalid(name, f"'{name}' must be a number in [{lo:g}, {hi:g}], got {quote(v)}")


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int | None = None, where: str | None = None) -> None:
    v = body.get(name)
    if v is None:
        return
    param = where or name
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(param, f"'{param}' must be an integer {bound}, got {quote(v)}")


def _enum(body: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> None:
    v = body.get(name)
    if v is not None and v not in allowed:
        raise invalid(name, f"'{name}' must be one of {', '.join(allowed)}, got {quote(v)}")


def _boolean(body: Mapping[str, Any], name: str) -> None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {quote(v)}")


def check_openai(body: Mapping[str, Any], chat: bool) -> None:
    """The OpenAI Chat Completions (`chat`) or legacy Completions rules above. Raises APIError 400 naming the
    field (the ranges chat and completions share are checked where the body is parsed, in protocol.py)."""
    _enum(body, "service_tier", _OPENAI_TIERS)
    if chat:
        _enum(body, "reasoning_effort", _REASONING_EFFORT)
        _enum(body, "verbosity", _VERBOSITY)
    else:
        _integer(body, "logprobs", 0, 5)


def check_anthropic(body: Mapping[str, Any], count_only: bool = False, interleaved: bool = False) -> None:
    """The Anthropic Messages rules above (`count_only`: /v1/messages/count_tokens, which takes no max_tokens;
    `interleaved`: the request's anthropic-beta header names interleaved thinking). Raises APIError 400 naming
    the field."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' is required (a model name)" if model is None
                      else f"'model' must be a non-empty string, got {quote(model)}")
    _number(body, "temperature", 0.0, 1.0)
    _number(body, "top_p", 0.0, 1.0)
    _integer(body, "top_k", 0)
    if not count_only:
        if body.get("max_tokens") is None:
            raise invalid("max_tokens", "'max_tokens' is required")
        _integer(body, "max_tokens", 1)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise invalid("stop_sequences", f"'stop_sequences' must be a list of strings, got {quote(stops)}")
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in _ANTHROPIC_CHOICES:
            raise invalid("tool_choice", f"'tool_choice' must be an object of type {', '.join(_ANTHROPIC_CHOICES)}"
                                         f", got {quote(choice)}")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        _thinking_budget(thinking.get("budget_tokens"), None if count_only or interleaved else body["max_tokens"])
    _enum(body, "service_tier", _ANTHROPIC_TIERS)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata", f"'metadata' must be an object, got {quote(metadata)}")
    _boolean(body, "stream")


def _thinking_budget(budget: Any, max_tokens: int | None) -> None:
    """Anthropic's `thinking.budget_tokens`: required, an integer >= MIN_THINKING_BUDGET, below `max_tokens`
    where one bounds it. Raises APIError 400 naming the field."""
    where = "thinking.budget_tokens"
    if budget is None:
        raise invalid(where, f"'{where}' is required for thinking of type enabled")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise invalid(where, f"'{where}' must be an integer >= {MIN_THINKING_BUDGET}, got {quote(budget)}")
    if max_tokens is not None and max_tokens <= budget:
        raise invalid("max_tokens", f"'max_tokens' must be greater than '{where}' ({max_tokens} <= {budget})")


def check_responses(body: Mapping[str, Any]) -> None:
    """The OpenAI Responses rules above. Raises APIError 400 naming the field."""
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    _integer(body, "max_output_tokens", 16)
    _integer(body, "top_logprobs", 0, 20)
    _integer(body, "max_tool_calls", 1)
    _enum(body, "truncation", _TRUNCATION)
    _enum(body, "service_tier", _OPENAI_TIERS)
    _boolean(body, "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None or choice in _RESPONSES_CHOICES:
        return
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise invalid("tool_choice", f"'tool_choice' must be none, auto, required or an object with a type, "
                                     f"got {quote(choice)}")
    if choice["type"] == "function" and not isinstance(choice.get("name"), str):
        raise invalid("tool_choice.name", "'tool_choice.name' is required for a tool_choice of type function")
