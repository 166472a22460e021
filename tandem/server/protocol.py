"""OpenAI request fields in one place: what is honoured, accepted with no effect, or refused; and their parsing.

`CHAT_FIELDS` / `COMPLETION_FIELDS` are the table a test pins. A field outside the table is ignored and named in
`GenerationRequest.ignored` (the server logs a warning and sends an `X-Tandem-Ignored-Fields` header); with
`strict=True` (`--strict-fields`) it answers 400 naming it. A refused field answers 400 naming it unless it holds a
harmless value (null, false, empty, or the one value we support). Sizes that cost work at every token are capped
(stop strings: MAX_STOPS of MAX_STOP_CHARS; stop_token_ids; tools: tools_request.MAX_TOOLS), nesting is bounded by
MAX_JSON_DEPTH, and error messages quote at most a short prefix of a bad value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from tandem.image_fetch import URLS_OFF, is_image_url
from tandem.sampling import (MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, MIN_TEMPERATURE,
                             SamplingParams)
from tandem.server.errors import MAX_QUOTE_CHARS, APIError, invalid, quote

HONOURED = "honoured"
NO_EFFECT = "accepted, no effect"
REFUSED = "refused"

_SAMPLING = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos"]
_COMMON = {"model": HONOURED, "max_tokens": HONOURED, "n": HONOURED, "stream": HONOURED,
           "stream_options": HONOURED, **{k: HONOURED for k in _SAMPLING},
           "min_tokens": HONOURED, "skip_special_tokens": NO_EFFECT,
           "spaces_between_special_tokens": NO_EFFECT, "user": NO_EFFECT, "metadata": NO_EFFECT, "store": NO_EFFECT,
           "service_tier": NO_EFFECT,
           "prompt_cache_key": NO_EFFECT, "safety_identifier": NO_EFFECT, "logit_bias": REFUSED,
           "cache_salt": HONOURED}
CHAT_FIELDS: dict[str, str] = {
    **_COMMON, "messages": HONOURED, "max_completion_tokens": HONOURED, "logprobs": HONOURED,
    "top_logprobs": HONOURED, "tools": HONOURED, "tool_choice": HONOURED, "parallel_tool_calls": HONOURED,
    "response_format": HONOURED, "chat_template_kwargs": HONOURED,
    "thinking_token_budget": HONOURED, "add_generation_prompt": HONOURED, "continue_final_message": HONOURED,
    "structured_outputs": HONOURED, "guided_json": HONOURED, "guided_regex": HONOURED, "guided_choice": HONOURED,
    "guided_grammar": HONOURED, "chat_template": REFUSED,
    "reasoning_effort": NO_EFFECT, "verbosity": NO_EFFECT,
    "functions": REFUSED, "function_call": REFUSED, "audio": REFUSED, "modalities": REFUSED,
    "prediction": REFUSED, "web_search_options": REFUSED}
COMPLETION_FIELDS: dict[str, str] = {
    **_COMMON, "prompt": HONOURED, "logprobs": HONOURED, "echo": REFUSED, "suffix": REFUSED, "best_of": REFUSED}
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "modalities": lambda v: v is None or v == ["text"], "best_of": lambda v: v is None or v == 1}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body (a schema of ~30 nested objects fits)


@dataclass
class GenerationRequest:
    """A validated request of either endpoint. `max_tokens` None: fill the context."""

    kind: str  # "chat" | "completion"
    model: str | None
    params: SamplingParams
    max_tokens: int | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking_token_budget: int | None = None
    min_tokens: int = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    ignored: list[str] = field(default_factory=list)
    cache_salt: str | None = None  # requests of different salts share no prefix-cache entries (as vLLM's)

    @property
    def forced_function(self) -> str | None:
        """The function name of a named tool_choice, else None."""
        return self.tool_choice.get("function", {}).get("name") if isinstance(self.tool_choice, dict) else None


def decode_body(raw: bytes) -> dict[str, Any]:
    """Parse a JSON request body. Raises APIError 400 for malformed JSON or a non-object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    _check_depth(body, MAX_JSON_DEPTH)
    return body


def _check_depth(value: Any, limit: int) -> None:
    """APIError 400 when arrays and objects nest deeper than `limit` (checked without recursion, so every later
    step that recurses, from templates to grammars to error messages, sees a bounded depth)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise APIError(400, f"the body nests arrays and objects deeper than {limit} levels",
                           code="invalid_json")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _empty(value: Any) -> bool:
    return value is None or value is False or value == {} or value == []


def _check_refused(body: Mapping[str, Any], table: Mapping[str, str], strict: bool) -> list[str]:
    unknown = sorted(name for name in body if name not in table)
    if unknown and strict:
        raise invalid(unknown[0], f"unknown field {quote(unknown[0])}")
    for name, status in table.items():
        if status != REFUSED or name not in body:
            continue
        value = body[name]
        harmless = _HARMLESS.get(name, _empty)
        if not harmless(value):
            raise invalid(name, f"'{name}' is not supported by this server")
    return shown_names(unknown)


MAX_IGNORED_SHOWN = 16  # unknown field names named in the warning and the X-Tandem-Ignored-Fields header


def shown_names(names: list[str]) -> list[str]:
    """Unknown field names as the warning and the response header show them: at most MAX_IGNORED_SHOWN, each cut
    to MAX_QUOTE_CHARS characters and escaped to printable ASCII (a header holds no control characters and Latin-1
    only: NUL becomes \\x00, "東" \\u6771), then "..." for the rest."""
    shown = [n[:MAX_QUOTE_CHARS].encode("unicode_escape").decode("ascii").replace(",", "\\x2c")
             for n in names[:MAX_IGNORED_SHOWN]]
    return shown + (["..."] if len(names) > MAX_IGNORED_SHOWN else [])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)) or not math.isfinite(v) or not lo <= v <= hi:
        raise invalid(name, f"'{name}' must be a number in [{lo}, {hi}], got {quote(v)}")
    return float(v)


def _int(body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"'{name}' must be an integer {bound}, got {quote(v)}")
    return int(v)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {quote(v)}")
    return v


def _stop(body: Mapping[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items) or len(items) > MAX_STOPS:
        raise invalid("stop", f"'stop' must be a string or a list of at most {MAX_STOPS} strings")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise invalid("stop", f"a stop string may hold at most {MAX_STOP_CHARS} characters")
    return [s for s in items if s]


def _temperature(body: Mapping[str, Any]) -> float:
    """The temperature; one below MIN_TEMPERATURE (5e-324, 1e-38, ...) is greedy, the limit it tends to."""
    t = _number(body, "temperature", 1.0, 0.0, 2.0)
    return 0.0 if t < MIN_TEMPERATURE else t


MIN_TOP_P = 1e-9  # the top token's share of any vocabulary under 10^9 ids is above it: its nucleus is that token


def _top_p(body: Mapping[str, Any]) -> float:
    """The top_p; 0 (in OpenAI's and Anthropic's range, 0..1) keeps the most likely token alone, the limit p -> 0
    tends to, as llama.cpp's sampler keeps its one min_keep token (vLLM refuses 0): any top_p below MIN_TOP_P
    is MIN_TOP_P, the smallest the sampler takes."""
    return max(_number(body, "top_p", 1.0, 0.0, 1.0), MIN_TOP_P)


def _sampling(body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS
                                 or not all(_is_int(t) and t >= 0 for t in stop_ids)):
        raise invalid("stop_token_ids", f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                        "non-negative integers")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise invalid("seed", f"'seed' must be an integer, got {quote(seed)}")
    return SamplingParams(
        temperature=_temperature(body), top_p=_top_p(body),
        top_k=_int(body, "top_k", 0, -1) or 0, min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-6, 100.0), seed=seed,
        max_tokens=max_tokens or 1, stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos", False),
        stop=_stop(body), logprobs=logprobs)


def _common(body: Mapping[str, Any], table: Mapping[str, str], strict: bool) -> dict[str, Any]:
    ignored = _check_refused(body, table, strict)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "'model' must be a string")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise invalid("cache_salt", "'cache_salt' must be a non-empty string")
    return {"model": model, "n": _int(body, "n", 1, 1, 16), "stream": _bool(body, "stream", False),
            "include_usage": bool((opts or {}).get("include_usage", False)), "ignored": ignored,
            "min_tokens": _int(body, "min_tokens", 0, 0) or 0, "cache_salt": salt}


def parse_completion(body: Mapping[str, Any], strict: bool = False) -> GenerationRequest:
    """Validate a /v1/completions body. Raises APIError 400 naming the first bad field."""
    common = _common(body, COMPLETION_FIELDS, strict)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        pass
    elif not isinstance(prompt, str) or not prompt:
        raise invalid("prompt", "'prompt' must be a non-empty string or list of token ids (one prompt per request)")
    max_tokens = _int(body, "max_tokens", 16, 1)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    return GenerationRequest("completion", params=_sampling(body, max_tokens, logprobs), max_tokens=max_tokens,
                             prompt=prompt, logprobs=logprobs is not None, top_logprobs=logprobs or 0, **common)


def _message(i: int, m: Any, allow_image_urls: bool = False) -> dict[str, Any]:
    where = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid(where, f"'{where}' must be an object with a role in {sorted(_ROLES)}")
    out = dict(m)
    if out["role"] == "developer":
        out["role"] = "system"
    content = m.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        # text and images, in order (tandem/multimodal.py reads them)
        out["content"] = image_parts(where, content, allow_image_urls)
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]", f"'{where}.content[{j}]' must be a text part (type 'text')")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise invalid(f"{where}.content", f"'{where}.content' must be a string or a list of text parts")
    elif content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
        raise invalid(f"{where}.content", f"'{where}.content' is required")
    calls = m.get("tool_calls")
    if calls is not None:
        out["tool_calls"] = [_history_call(f"{where}.tool_calls[{k}]", c) for k, c in enumerate(calls)] \
            if isinstance(calls, list) else _raise(f"{where}.tool_calls", "must be a list")
    return out


def image_parts(where: str, content: list[Any], allow_urls: bool = False) -> list[dict[str, Any]]:
    """A content list of text and ``image_url`` parts ({"url": <data URI or http(s) URL>} or the URL string),
    checked for shape only (the images are fetched and decoded where the prompt is built). ``allow_urls``: the
    server fetches http(s) URLs (``--allow-image-urls``); without it they are refused here.
    Raises APIError 400 naming the bad part."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            continue
        url = part.get("image_url") if kind == "image_url" else None
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise invalid(param, f"'{param}' must be a text part or an image_url part with a url")
        if is_image_url(url) and not allow_urls:
            raise invalid(param, f"'{param}': {URLS_OFF}")
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _raise(param: str, what: str) -> Any:
    raise invalid(param, f"'{param}' {what}")


def _history_call(where: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(where, f"'{where}' must hold a function with a name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError as exc:
            raise invalid(f"{where}.function.arguments", "tool-call arguments must be a JSON object") from exc
    return {**call, "function": {"name": fn["name"], "arguments": args}}


def parse_chat(body: Mapping[str, Any], strict: bool = False, allow_image_urls: bool = False) -> GenerationRequest:
    """Validate a /v1/chat/completions body. ``allow_image_urls``: http(s) image URLs are kept for the server to
    fetch (``--allow-image-urls``), else refused. Raises APIError 400 naming the first bad field."""
    from tandem.server.tools_request import parse_tools  # the tools fields have their own module

    common = _common(body, CHAT_FIELDS, strict)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list")
    parsed = [_message(i, m, allow_image_urls) for i, m in enumerate(messages)]
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    max_tokens = _int(body, "max_tokens", max_tokens, 1)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS) or 0
    if top and not want_logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    tools, choice, parallel, fmt = parse_tools(body)
    return GenerationRequest("chat", params=_sampling(body, max_tokens, top if want_logprobs else None),
                             max_tokens=max_tokens, messages=parsed, logprobs=want_logprobs, top_logprobs=top,
                             tools=tools, tool_choice=choice, parallel_tool_calls=parallel, response_format=fmt,
                             chat_template_kwargs=kwargs,
                             thinking_token_budget=_int(body, "thinking_token_budget", None, 0),
                             add_generation_prompt=_bool(body, "add_generation_prompt", True),
                             continue_final_message=_bool(body, "continue_final_message", False), **common)
