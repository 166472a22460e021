"""Error fields in each API's own names: the Anthropic and Responses routes translate their bodies to a chat
request (anthropic_request.py, responses_request.py), so a 400 raised while the chat request is checked names the
chat field; `rename_param` gives it back the name the client sent (`text.format` rather than `response_format`,
`tools[0].input_schema` rather than `tools[0].function.parameters`), in `param` and in the message."""

from __future__ import annotations

import re

from tandem.server.errors import APIError

# route -> [(chat field pattern, the route's own name)], the first match wins; \g<i> keeps an index
_RENAMES: dict[str, list[tuple[re.Pattern[str], str]]] = {
    "responses": [(re.compile(p), r) for p, r in [
        (r"^response_format\.json_schema\.schema", "text.format.schema"),
        (r"^response_format", "text.format"),
        (r"^max_tokens\b", "max_output_tokens"),
        (r"^tools\[(?P<i>\d+)\]\.function\.", r"tools[\g<i>]."),
    ]],
    "messages": [(re.compile(p), r) for p, r in [
        (r"^stop\b", "stop_sequences"),
        (r"^thinking_token_budget\b", "thinking.budget_tokens"),
        (r"^tools\[(?P<i>\d+)\]\.function\.parameters", r"tools[\g<i>].input_schema"),
        (r"^tools\[(?P<i>\d+)\]\.function\.", r"tools[\g<i>]."),
    ]],
}
_RENAMES["count_tokens"] = _RENAMES["messages"]


def rename_param(route: str, err: APIError) -> APIError:
    """`err` with its `param` (and the quoted field in its message) in the names of `route`'s API; unchanged for
    a route that speaks chat, or a field whose name is the same."""
    if err.param is None:
        return err
    for pattern, repl in _RENAMES.get(route, []):
        m = pattern.match(err.param)
        if m is None:
            continue
        quoted = re.compile("(?<=')" + pattern.pattern.removeprefix("^"))  # the field quoted in the message
        err.message = quoted.sub(repl, err.message)
        err.param = pattern.sub(repl, err.param, count=1)
        break
    return err
