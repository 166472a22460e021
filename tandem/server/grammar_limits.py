"""Bounds on what a request may ask the grammar compiler to build, and the big-stack thread it runs on.

llguidance compiles a JSON schema or a Lark grammar recursively in native code: a long enough chain of `$ref`
definitions, of `anyOf` alternatives or of Lark rules overflows the native stack and the process dies (SIGSEGV),
whatever thread it runs on. Measured with llguidance 0.23 on an 8 MB thread stack (Linux's default, the main
thread's and Python's worker threads'): a chain of 800 `$ref` object definitions (about 2,400 levels of nesting
with the references followed) compiles and 1,000 crash; 1,000 `anyOf`-of-`$ref` links compile and 3,000 crash;
2,500 chained Lark rules compile and 2,800 crash. On a 64 MB stack (`COMPILE_STACK_BYTES`) 4,000 `$ref` links,
6,000 `anyOf` links and 10,000 Lark rules compile. So before the compiler runs, every schema and grammar of a
request is measured here against these limits, far below what overflows even the default stack, and the compile
itself runs on a thread with a 64 MB stack (`run_on_big_stack`): the limits are the contract, the stack the margin.

| limit | value | what it counts |
|---|---|---|
| MAX_SCHEMA_DEPTH | 512 | nesting of a schema's objects and arrays, each `$ref` followed (a cycle counted once) |
| MAX_SCHEMA_NODES | 20,000 | objects and arrays in one schema, references not followed |
| MAX_SCHEMA_DEFS | 1,000 | entries of `$defs` / `definitions` |
| MAX_GRAMMAR_DEPTH | 512 | a Lark grammar's longest chain of rule references (a cycle counted once), with |
| | | each rule's bracket nesting added |
| MAX_GRAMMAR_RULES | 2,000 | rules and terminals of a Lark grammar |
| MAX_GRAMMAR_BYTES | 256 KiB | the Lark text (UTF-8) |
| MAX_CHOICES | 4,096 | `guided_choice` entries; also the values of one `enum` |
| MAX_CHOICE_BYTES | 256 KiB | the `guided_choice` entries together (UTF-8) |

A request over a limit gets a 400 (code "grammar_too_large") naming the limit and the request field.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from tandem.server.errors import APIError

MAX_SCHEMA_DEPTH = 512
MAX_SCHEMA_NODES = 20_000
MAX_SCHEMA_DEFS = 1_000
MAX_GRAMMAR_DEPTH = 512
MAX_GRAMMAR_RULES = 2_000
MAX_GRAMMAR_BYTES = 256 * 1024
MAX_CHOICES = 4_096
MAX_CHOICE_BYTES = 256 * 1024
COMPILE_STACK_BYTES = 64 * 1024 * 1024  # virtual: pages are committed only as the compiler touches them

T = TypeVar("T")


def _too_large(param: str, what: str) -> APIError:
    return APIError(400, f"'{param}' is too large to compile: {what}", param=param, code="grammar_too_large")


def _children(node: Any) -> Iterator[Any]:
    items = node.values() if isinstance(node, dict) else node
    return (c for c in items if isinstance(c, (dict, list)))


def _pointer(root: Any, ref: str) -> Any:
    """The node a local JSON pointer ("#/$defs/a") names in `root`, or None (remote or dangling)."""
    if not ref.startswith("#"):
        return None
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None


def _longest_chain(roots: list[Any], edges: Callable[[Any], list[Any]], weight: Callable[[Any], int],
                   key: Callable[[Any], Any], limit: int) -> int:
    """The largest sum of `weight` along a path of `edges` from any root (a node already on the path ends it, so
    a cycle counts once), memoised, without recursion; stops early once it passes `limit`."""
    best: dict[Any, int] = {}
    for root in roots:
        if key(root) in best:
            continue
        on_path = {key(root)}
        stack: list[tuple[Any, list[Any], int]] = [(root, edges(root), 0)]
        while stack:
            node, todo, deepest = stack[-1]
            if todo:
                child = todo.pop()
                k = key(child)
                if k in best:
                    stack[-1] = (node, todo, max(deepest, best[k]))
                elif k not in on_path:
                    on_path.add(k)
                    stack.append((child, edges(child), 0))
                    if len(stack) > limit:
                        return len(stack)
                continue
            stack.pop()
            on_path.discard(key(node))
            value = weight(node) + deepest
            best[key(node)] = value
            if value > limit:
                return value
            if stack:
                parent, ptodo, pdeep = stack[-1]
                stack[-1] = (parent, ptodo, max(pdeep, value))
    return max((best.get(key(r), 0) for r in roots), default=0)


def check_schema(schema: Any, param: str) -> None:
    """Raise APIError 400 (code "grammar_too_large", naming `param`) when a JSON schema exceeds MAX_SCHEMA_NODES,
    MAX_SCHEMA_DEFS, MAX_SCHEMA_DEPTH (references followed) or MAX_CHOICES values in one `enum`."""
    if not isinstance(schema, (dict, list)):
        return
    nodes, stack = 0, [schema]
    while stack:
        node = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _too_large(param, f"more than {MAX_SCHEMA_NODES} objects and arrays (MAX_SCHEMA_NODES)")
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_CHOICES:
                raise _too_large(param, f"an enum of {len(enum)} values; the limit is {MAX_CHOICES} (MAX_CHOICES)")
            defs = sum(len(node[k]) for k in ("$defs", "definitions") if isinstance(node.get(k), dict))
            if defs > MAX_SCHEMA_DEFS:
                raise _too_large(param, f"{defs} definitions; the limit is {MAX_SCHEMA_DEFS} (MAX_SCHEMA_DEFS)")
        stack.extend(_children(node))

    def edges(node: Any) -> list[Any]:
        out = list(_children(node))
        ref = node.get("$ref") if isinstance(node, dict) else None
        target = _pointer(schema, ref) if isinstance(ref, str) else None
        return out + [target] if target is not None else out

    depth = _longest_chain([schema], edges, lambda _: 1, id, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise _too_large(param, f"nested more than {MAX_SCHEMA_DEPTH} levels deep with its $refs followed "
                                "(MAX_SCHEMA_DEPTH)")


_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)\s*(?:\[[^\]\n]*\])?\s*(?:\.\s*-?\d+\s*)?:(.*)$")
_STRIP = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|<\[[^\]\n]*\]>')
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_JSON_AT = re.compile(r"%json\b\s*")


def _embedded_json(text: str, param: str) -> str:
    """`text` with each `%json {...}` schema removed, every one of them checked by `check_schema`."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    for m in _JSON_AT.finditer(text):
        if m.start() < pos:
            continue
        try:
            schema, end = decoder.raw_decode(text, m.end())
        except (ValueError, RecursionError):
            continue
        check_schema(schema, param)
        out.append(text[pos:m.start()])
        pos = end
    return "".join(out) + text[pos:]


def _nesting(body: str) -> int:
    deepest = level = 0
    for ch in body:
        if ch in "([{":
            level += 1
            deepest = max(deepest, level)
        elif ch in ")]}":
            level = max(0, level - 1)
    return deepest


def check_lark(text: str, param: str) -> None:
    """Raise APIError 400 (code "grammar_too_large", naming `param`) when a Lark grammar exceeds
    MAX_GRAMMAR_BYTES, MAX_GRAMMAR_RULES or MAX_GRAMMAR_DEPTH, or embeds a `%json` schema over the schema
    limits (`check_schema`)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise _too_large(param, f"{size} bytes; the limit is {MAX_GRAMMAR_BYTES} (MAX_GRAMMAR_BYTES)")
    rules: dict[str, str] = {}
    current: str | None = None
    for line in _embedded_json(text, param).splitlines():
        m = _RULE.match(line)
        if m is not None:
            current = m.group(1)
            rules[current] = rules.get(current, "") + " " + m.group(2)
            if len(rules) > MAX_GRAMMAR_RULES:
                raise _too_large(param, f"more than {MAX_GRAMMAR_RULES} rules (MAX_GRAMMAR_RULES)")
        elif current is not None and line.strip().startswith("|"):
            rules[current] += " " + line
        elif not line.startswith((" ", "\t")):
            current = None
    bodies = {name: _STRIP.sub(" ", body) for name, body in rules.items()}
    refs = {name: sorted({r for r in _NAME.findall(body) if r in rules}) for name, body in bodies.items()}
    nest = {name: _nesting(body) for name, body in bodies.items()}
    depth = _longest_chain(list(rules), lambda n: list(refs[n]), lambda n: 1 + nest[n], lambda n: n,
                           MAX_GRAMMAR_DEPTH)
    if depth > MAX_GRAMMAR_DEPTH:
        raise _too_large(param, f"a chain of rule references (with their bracket nesting) over "
                                f"{MAX_GRAMMAR_DEPTH} deep (MAX_GRAMMAR_DEPTH)")


def check_choices(choices: list[str], param: str) -> None:
    """Raise APIError 400 (code "grammar_too_large", naming `param`) past MAX_CHOICES entries or
    MAX_CHOICE_BYTES of text."""
    if len(choices) > MAX_CHOICES:
        raise _too_large(param, f"{len(choices)} choices; the limit is {MAX_CHOICES} (MAX_CHOICES)")
    size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choices)
    if size > MAX_CHOICE_BYTES:
        raise _too_large(param, f"{size} bytes of choices; the limit is {MAX_CHOICE_BYTES} (MAX_CHOICE_BYTES)")


_STACK_LOCK = threading.Lock()


def start_thread(target: Callable[[], None], name: str, stack_bytes: int = COMPILE_STACK_BYTES) -> threading.Thread:
    """Start a daemon thread running `target` with a `stack_bytes` stack (threading.stack_size is process-wide,
    so it is set and restored under a lock around the start)."""
    thread = threading.Thread(target=target, daemon=True, name=name)
    with _STACK_LOCK:
        old = threading.stack_size(stack_bytes)
        try:
            thread.start()
        finally:
            threading.stack_size(old)
    return thread


def run_on_big_stack(fn: Callable[[], T]) -> T:
    """`fn()` on a fresh thread with a COMPILE_STACK_BYTES stack; returns its result or raises its exception.
    The caller's thread waits (it is a request-preparation thread, never the event loop)."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    start_thread(body, "tandem-compile").join()
    if error:
        raise error[0]
    return result[0]


def format_param(fmt: Mapping[str, Any], default: str) -> str:
    """The request field an output format came from (tools_request puts it in "param"), else `default`."""
    param = fmt.get("param")
    return param if isinstance(param, str) else default
