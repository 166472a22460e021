"""Grammars through llguidance: JSON schema outputs and forced tool calls (Lark), and the closers that end them.

The grammar covers the answer, not the reasoning; `tandem.server.constraint.GrammarConstraint`
applies it as the Engine `constraint`. After the grammar completes, only the eos ids are allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import orjson

from tandem.server.errors import APIError
from tandem.server.grammar_limits import run_on_big_stack
from tandem.tokenizer import Tokenizer

__all__ = ["GrammarCompiler", "closers", "json_grammar", "tool_call_grammar"]


class GrammarCompiler:
    """Builds llguidance matchers for one tokenizer (the LLTokenizer is built once: ~1 s for a 248k vocabulary).

    Args:
        tokenizer: the engine's tokenizer (its tokenizer.json is what llguidance reads).
        vocab_size: V, the model's logits width (may exceed the tokenizer's).
        eos_token_ids: the ids that end generation once the grammar is complete.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        eos = list(eos_token_ids) or [t for t in (tokenizer.eos_token_id,) if t is not None]
        self.llg_tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos

    def marker(self, text: str) -> str:
        """A Lark term for `text`: the special-token form when it is one special token, else a literal."""
        token = self.tokenizer.token_id(text)
        if token is not None and self.llg_tokenizer.is_special_token(token):
            return f"<[{token}]>"
        return _lit(text)

    def matcher(self, lark: str, param: str) -> llguidance.LLMatcher:
        """A fresh matcher for a Lark grammar. Raises APIError 400 (naming `param`) when it does not compile."""
        def build() -> llguidance.LLMatcher:
            return llguidance.LLMatcher(self.llg_tokenizer, llguidance.LLMatcher.grammar_from_lark(lark),
                                        log_level=0)

        try:  # on a big stack (grammar_limits): the native compiler recurses
            m = run_on_big_stack(build)
        except (ValueError, TypeError, RuntimeError) as exc:  # the grammar text itself is refused
            raise APIError(400, f"cannot build a grammar for '{param}': {compiler_message(str(exc))}",
                           param=param) from exc
        if m.is_error():
            raise APIError(400, f"cannot build a grammar for '{param}': {compiler_message(m.get_error())}",
                           param=param)
        return m


def compiler_message(text: str) -> str:
    """The compiler's error for a client: its first line, at most 300 characters, never a backtrace or a panic's
    source location."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "the grammar was refused")
    if re.match(r"^(panic|thread '[^']*' panicked)", line):  # an assertion inside the compiler, not a user error
        return "the grammar compiler gave up on it (too many symbols or rules)"
    return line[:300] + ("…" if len(line) > 300 else "")


def _lit(text: str) -> str:
    return orjson.dumps(text).decode()


_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: Mapping[str, Any], lenient: bool = False) -> str:
    # The separators json.dumps (and the template's tojson) writes; no free whitespace, so an answer always ends.
    # `lenient` (tool arguments): keywords llguidance does not implement (propertyNames, ...) are not enforced
    # rather than refused, so an agent's tool list with one such schema still gets its calls held.
    options = {**_COMPACT, "lenient": True} if lenient else _COMPACT
    return "%json " + orjson.dumps({"x-guidance": options, **schema}).decode()


def json_grammar(schema: Mapping[str, Any]) -> str:
    """Lark for an answer that is one JSON value of `schema` (optional leading newlines/spaces)."""
    return f"start: ws? body\nws: /[ \\n]{{1,3}}/\nbody: {_json(schema)}\n"


def _string_rule(schema: Mapping[str, Any]) -> str:
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return " | ".join(_lit(v + "\n</parameter>\n") for v in enum)
    limit = schema.get("maxLength")
    span = f"{{0,{int(limit)}}}" if isinstance(limit, int) and limit >= 0 else "*"
    return f"/(?s:.{span})\\n<\\/parameter>\\n/"


def _xml_function(compiler: GrammarCompiler, k: int, fn: Mapping[str, Any]) -> list[str]:
    params = fn.get("parameters") or {}
    props: Mapping[str, Any] = params.get("properties") or {}
    required = set(params.get("required") or [])
    parts, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        rule = f"p{k}_{j}"
        head = _lit(f"<parameter={key}>\n")
        types = {schema.get("type")} if isinstance(schema, Mapping) else set()
        if types == {"string"}:
            rules += [f"{rule}: {head} v{k}_{j}", f"v{k}_{j}[lazy]: {_string_rule(schema)}"]
        else:
            rules += [f"{rule}: {head} v{k}_{j} {_lit(chr(10) + '</parameter>' + chr(10))}",
                      f"v{k}_{j}: {_json(schema if isinstance(schema, Mapping) else {}, lenient=True)}"]
        parts.append(rule if key in required else f"{rule}?")
    body = " ".join(parts)
    open_fn = _lit(f"<function={fn['name']}>\n")
    close = _lit("</function>\n")
    rules.insert(0, f"fn{k}: {compiler.marker('<tool_call>')} {_lit(chr(10))} {open_fn} {body} {close} "
                    f"{compiler.marker('</tool_call>')}")
    return rules


def _json_function(compiler: GrammarCompiler, k: int, fn: Mapping[str, Any]) -> list[str]:
    head = _lit('\n{"name": ' + orjson.dumps(fn["name"]).decode() + ', "arguments": ')
    params = {"additionalProperties": False, **(fn.get("parameters") or {"type": "object"})}
    return [f"fn{k}: {compiler.marker('<tool_call>')} {head} args{k} {_lit(chr(125) + chr(10))} "
            f"{compiler.marker('</tool_call>')}", f"args{k}: {_json(params, lenient=True)}"]


def tool_call_grammar(compiler: GrammarCompiler, tools: Sequence[Mapping[str, Any]], form: str,
                      only: str | None, parallel: bool) -> str:
    """Lark for one or more tool calls (of `only`, or of any tool) in the template's form ("xml" or "json")."""
    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    rules = []
    for k, fn in enumerate(fns):
        rules += _xml_function(compiler, k, fn) if form == "xml" else _json_function(compiler, k, fn)
    call = " | ".join(f"fn{k}" for k in range(len(fns)))
    repeat = f" ({_lit(chr(10))} call)*" if parallel else ""
    return "\n".join([f"start: ws? call{repeat}", "ws: /[ \\n]{1,3}/", f"call: {call}", *rules]) + "\n"


_CLOSE_TEXTS = {"xml": ["\n</parameter>\n", "</function>\n</tool_call>", "\n</tool_call>"],
                "json": ["}\n</tool_call>", "\n</tool_call>"]}
_VALUE_TEXTS = ['"', "]", "}", "0", '""', "[]", "{}", "false"]


def closers(tokenizer: Tokenizer, form: str | None) -> list[list[int]]:
    """Token sequences that end an answer's open structures (tried in order by the closing phase): the tool-call
    form's closing tags (`form` "xml" / "json"; None for a plain JSON answer), then JSON value closers and the
    shortest JSON values."""
    texts = (_CLOSE_TEXTS.get(form, []) if form else []) + _VALUE_TEXTS
    return [tokenizer.encode(t) for t in texts]


def _min_value(schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if isinstance(schema, Mapping) and isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if isinstance(schema, Mapping) and kind == "object":
        props = schema.get("properties")
        required = schema.get("required")
        if not isinstance(props, Mapping) or not isinstance(required, list):
            return {}
        return {k: _min_value(props.get(k)) for k in required if isinstance(k, str) and k in props}
    return {"string": "", "integer": 0, "number": 0, "boolean": False, "array": [], "null": None}.get(str(kind), 0)


def min_answer_tokens(tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None, form: str | None,
                      only: str | None, schema: Mapping[str, Any] | None = None) -> int:
    """Tokens of the shortest complete answer (the smallest call of any allowed tool, with each required argument
    at its shortest value; or the shortest JSON of `schema`): how much budget the closing phase keeps."""
    if schema is not None:
        return len(tokenizer.encode(orjson.dumps(_min_value(schema)).decode()))
    most = 0
    for tool in tools or []:
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        args = _min_value({**(fn.get("parameters") or {}), "type": "object"})
        args = args if isinstance(args, dict) else {}
        if form == "json":
            text = '<tool_call>\n{"name": ' + orjson.dumps(fn["name"]).decode() + ', "arguments": ' + \
                orjson.dumps(args).decode() + "}\n</tool_call>"
        else:
            body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else orjson.dumps(v).decode()}\n"
                           "</parameter>\n" for k, v in args.items())
            text = f"<tool_call>\n<function={fn['name']}>\n{body}</function>\n</tool_call>"
        most = max(most, len(tokenizer.encode(text)))
    return most
