"""vLLM's `POST /tokenize` and `POST /detokenize`: what a prompt costs in tokens, and the text of token ids.

/tokenize takes {"prompt": text, "add_special_tokens"?} (the text as /v1/completions encodes it) or {"messages":
[...], "tools"?, "add_generation_prompt"?, "chat_template_kwargs"?, ...} (the prompt /v1/chat/completions renders,
with the server's default template kwargs) and answers {"count", "max_model_len", "tokens", "token_strs"};
/detokenize takes {"tokens": [ids]} and answers {"prompt": text}. Shapes: vLLM's OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tandem.server.errors import APIError, invalid
from tandem.server.image_urls import fetch_image_urls
from tandem.server.protocol import GenerationRequest, decode_body, parse_chat
from tandem.server.runner import render_prompt
from tandem.server.state import json_response, read_body

if TYPE_CHECKING:
    from tandem.server.state import ServerState

_TEXT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_IDS_FIELDS = {"model", "tokens"}


def _chat_request(body: dict[str, Any], state: ServerState) -> GenerationRequest | None:
    """The chat request of a /tokenize body with messages (None for a text prompt)."""
    if "messages" not in body:
        return None
    chat = {k: v for k, v in body.items() if k != "return_token_strs"}
    req = parse_chat({**chat, "max_tokens": 1}, state.options.strict_fields, state.allow_image_urls)
    req.chat_template_kwargs = {**state.options.default_template_kwargs, **req.chat_template_kwargs}
    return req


def _tokenize(body: dict[str, Any], req: GenerationRequest | None, state: ServerState) -> dict[str, Any]:
    engine = state.engine
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    if req is not None:
        ids = render_prompt(engine, req)
    else:
        unknown = sorted(k for k in body if k not in _TEXT_FIELDS)
        if unknown and state.options.strict_fields:
            raise invalid(unknown[0], "unknown field")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt", "'prompt' must be a string (or send 'messages')")
        ids = tok.encode(prompt)
    strs = [tok.decode([t]) for t in ids] if body.get("return_token_strs") is True else None
    return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": strs}


def _detokenize(body: dict[str, Any], state: ServerState) -> dict[str, Any]:
    tok = state.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid("tokens", "'tokens' must be a list of token ids")
    if any(t < 0 or t >= state.engine.vocab_size for t in ids):
        raise invalid("tokens", f"token ids must lie in [0, {state.engine.vocab_size})")
    return {"prompt": tok.decode(ids)}


async def _run(request: Request, state: ServerState, fn: Callable[[dict[str, Any], ServerState], Any]) -> Response:
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)

    def work() -> Any:
        return fn(decode_body(raw), state)

    return json_response(await asyncio.get_running_loop().run_in_executor(state.prep, work))


async def tokenize_route(request: Request, state: ServerState) -> Response:
    """POST /tokenize (a request's image URLs, with --allow-image-urls, fetched between parsing and rendering:
    image_urls.py)."""
    raw = await read_body(request, state.max_body_bytes, state.body_timeout_s)
    loop = asyncio.get_running_loop()

    def parse() -> tuple[dict[str, Any], GenerationRequest | None]:
        body = decode_body(raw)
        return body, _chat_request(body, state)

    body, req = await loop.run_in_executor(state.prep, parse)
    if req is not None:
        await fetch_image_urls(state, req)
    return json_response(await loop.run_in_executor(state.prep, _tokenize, body, req, state))


async def detokenize_route(request: Request, state: ServerState) -> Response:
    """POST /detokenize."""
    return await _run(request, state, _detokenize)


def tokenize_routes(state: ServerState, route: Callable[..., Any]) -> list[Route]:
    """/tokenize and /detokenize (OpenAI's error shape; the API key applies)."""
    return [Route("/tokenize", route("tokenize", tokenize_route, state), methods=["POST"]),
            Route("/detokenize", route("detokenize", detokenize_route, state), methods=["POST"])]
