"""Chat template: render a conversation into the prompt text the model was trained on.

Source: the checkpoint's `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (spec/qwen3_5.md
§11.2). Rendering follows transformers' `apply_chat_template` environment so the same template gives the same
string: an immutable sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks`, the `loopcontrols`
extension, a no-op `{% generation %}` block, a `tojson` filter that keeps non-ASCII and does not HTML-escape,
and the globals `raise_exception` and `strftime_now`; the special-token strings (`bos_token`, `eos_token`, ...)
are template variables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.tokenizer import _token_string, read_tokenizer_config

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Placeholders for control-token strings found in user text: a private-use character, an index, another.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}([0-9]+){_CLOSE}")


class ChatTemplateError(ValueError):
    """The template called `raise_exception(message)` (e.g. a system message that is not first)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ' and sorts keys; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _pick_template(value: Any, where: Path) -> str:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
        raise ValueError(f"{where}: chat_template list has no 'default' entry (names: {sorted(map(str, named))})")
    raise ValueError(f"{where}: chat_template must be a string or a list of {{name, template}}")


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may use.

    Args:
        source: the Jinja template text.
        special_tokens: template variables such as {"eos_token": "<|im_end|>", "bos_token": None}.
    Raises:
        ValueError: when the template does not compile (the message names the Jinja syntax error).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        self.source = source
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """Load the template of a checkpoint directory.

        Reads `chat_template.jinja` when present, else `tokenizer_config.json`'s `chat_template`; special-token
        strings come from `tokenizer_config.json` either way.

        Returns:
            the ChatTemplate, or None when the checkpoint has no template.
        Raises:
            ValueError: malformed tokenizer_config.json or chat_template entry, or a template that does not compile.
        """
        root = Path(path)
        config = read_tokenizer_config(root)
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        elif config.get("chat_template") is not None:
            source = _pick_template(config["chat_template"], root / "tokenizer_config.json")
        else:
            return None
        specials = {key: _token_string(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        return cls(source, specials)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, enable_thinking: bool | None = None,
               **template_kwargs: Any) -> str:
        """Render a conversation to prompt text.

        Args:
            messages: OpenAI-style messages ({"role", "content", optional "reasoning_content", "tool_calls"});
                content is a string or a list of parts ({"type": "text", "text": ...}), passed through as given.
                Tool-call arguments should be mappings (JSON-decode OpenAI's string form first).
            tools: tool definitions (OpenAI `{"type": "function", "function": {...}}`), or None.
            add_generation_prompt: end with the assistant turn opener (Qwen3.5: `<|im_start|>assistant\\n<think>\\n`).
            enable_thinking: passed to the template only when not None (Qwen3.5: False closes the think block).
            template_kwargs: further template variables; they override the special-token variables.
        Returns:
            the prompt text (encode it with `Tokenizer.encode`, which maps special-token strings to their ids).
        Raises:
            ChatTemplateError: the template rejected the conversation (`raise_exception`).
            ValueError: messages is not a list of mappings.
        """
        if not all(isinstance(m, Mapping) for m in messages):  # a str fails too: its items are str
            raise ValueError("messages must be a list of mappings with 'role' and 'content'")
        variables: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._template.render(messages=list(messages), tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


_FIRSTS: dict[re.Pattern[str], str] = {}  # render_segments' pattern -> the first characters of its strings


def _escape(value: Any, pattern: re.Pattern[str], table: dict[str, int]) -> Any:
    """`value` with every match of `pattern` in its strings (keys too) replaced by a placeholder; `table` maps
    each replaced string to its placeholder index."""
    def one(m: re.Match[str]) -> str:
        return f"{_OPEN}{table.setdefault(m.group(0), len(table))}{_CLOSE}"

    if isinstance(value, str):
        # most text holds none of the strings' first characters: a scan per character (memchr) is far quicker
        # than the pattern's alternation over a long message
        firsts = _FIRSTS.get(pattern)
        return pattern.sub(one, value) if firsts is None or any(c in value for c in firsts) else value
    if isinstance(value, Mapping):
        return {_escape(k, pattern, table): _escape(v, pattern, table) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape(v, pattern, table) for v in value]
    return value


def render_segments(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], control: Sequence[str], *,
                    tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> list[tuple[str, bool]]:
    """Render a conversation so that control tokens come only from the template: [(text, is_user_text)].

    Every occurrence of a `control` string (the tokenizer's special tokens) inside messages, tools or template
    variables, and every placeholder character, is swapped for a placeholder before rendering; the rendered
    prompt is then cut at the placeholders. Segments with is_user_text False are the template's text (encode
    them normally: their special-token strings are the real control tokens); True marks a string the user
    wrote (encode it as text: `Tokenizer.encode_as_text`). A conversation without such strings renders to one
    segment, exactly `template.render(...)`.
    Raises: as `ChatTemplate.render`.
    """
    table: dict[str, int] = {}
    if control:
        alternatives = sorted({*control, _OPEN, _CLOSE}, key=lambda t: (-len(t), t))
        pattern = re.compile("|".join(re.escape(t) for t in alternatives))
        _FIRSTS.setdefault(pattern, "".join(sorted({t[0] for t in alternatives if t})))
        messages = _escape(list(messages), pattern, table)
        tools = _escape(tools, pattern, table) if tools is not None else None
        template_kwargs = _escape(template_kwargs, pattern, table)
    text = template.render(messages, tools=tools, **template_kwargs)
    if not table:
        return [(text, False)]
    originals = {index: s for s, index in table.items()}
    segments: list[tuple[str, bool]] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(text):
        index = int(m.group(1))
        if index not in originals:
            continue
        if m.start() > pos:
            segments.append((text[pos:m.start()], False))
        segments.append((originals[index], True))
        pos = m.end()
    if pos < len(text):
        segments.append((text[pos:], False))
    return segments
