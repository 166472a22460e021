"""Engine chunks -> OpenAI objects: per-choice reasoning/tool-call splitting, whole responses and SSE chunks."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from tandem.engine import Engine
from tandem.generation import GenerationChunk, TokenLogprob
from tandem.server.errors import internal_error
from tandem.server.reasoning import ReasoningSplitter
from tandem.server.runner import Plan, logprob_entry, token_text
from tandem.server.scheduler import Job
from tandem.server.tool_parser import ToolCall, ToolCallParser

log = logging.getLogger("tandem.server")

Event = tuple[str, Any]  # ("reasoning" | "content", str) or ("call", ToolCall)


class ChoiceOutput:
    """The text pipeline of one choice: reasoning split (chat), then tool-call parsing (when tools are parsed)."""

    def __init__(self, plan: Plan) -> None:
        chat = plan.request.kind == "chat"
        self.splitter = ReasoningSplitter(plan.in_reasoning) if chat else None
        self.parser = ToolCallParser(plan.request.tools or [], plan.tool_form) if plan.tool_form else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.cut_call = False
        self.inline_reasoning = plan.inline_reasoning and chat  # --reasoning-format content
        self.think = "none"  # inline reasoning: "none" / "open" / "closed"

    def feed(self, chunk: GenerationChunk) -> list[Event]:
        """Take one engine chunk; return the events to send (recorded for the whole response too)."""
        self.num_tokens += len(chunk.token_ids)
        self.logprobs += chunk.logprobs
        final = chunk.finish_reason is not None
        events: list[Event] = []
        if self.splitter is None:
            events = [("content", chunk.text)] if chunk.text else []
        else:
            reasoning, content = self.splitter.push(chunk.text)
            if final:
                more_r, more_c = self.splitter.finish()
                reasoning, content = reasoning + more_r, content + more_c
            if reasoning:
                events.append(("reasoning", reasoning))
            if self.parser is not None:
                events += self.parser.push(content)
                if final:
                    self.cut_call = self.parser.in_call  # a call cut off by the budget: nothing of it is sent
                    if self.cut_call:
                        self.parser.buf, self.parser.in_call = "", False
                    events += self.parser.finish()
            elif content:
                events.append(("content", content))
        if self.inline_reasoning:
            events = self._inline(events, final)
        for kind, value in events:
            if kind == "call":
                self.calls.append(value)
            else:
                (self.reasoning if kind == "reasoning" else self.content).append(value)
        if final:
            self.finish_reason = "tool_calls" if self.calls and not self.cut_call else chunk.finish_reason
        return events


    def _inline(self, events: list[Event], final: bool) -> list[Event]:
        """Reasoning kept in the content, between `<think>` and `</think>`."""
        out: list[Event] = []
        for kind, value in events:
            if kind == "reasoning":
                out.append(("content", value if self.think == "open" else "<think>\n" + value))
                self.think = "open"
                continue
            if self.think == "open":
                out.append(("content", "\n</think>\n\n"))
                self.think = "closed"
            out.append((kind, value))
        if final and self.think == "open":
            out.append(("content", "\n</think>"))
            self.think = "closed"
        return out


def chat_logprobs(engine: Engine, lps: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [{**logprob_entry(engine, lp.token_id, lp.logprob),
                         "top_logprobs": [logprob_entry(engine, t, v) for t, v in lp.top]} for lp in lps]}


def completion_logprobs(engine: Engine, lps: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_text(engine, lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(engine, t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def _call_object(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


def usage(plan: Plan, outputs: list[ChoiceOutput]) -> dict[str, Any]:
    """OpenAI usage: prompt, completion and total token counts; prompt_tokens_details.cached_tokens: the prompt
    tokens restored from the prefix cache."""
    done = sum(o.num_tokens for o in outputs)
    return {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": done,
            "total_tokens": len(plan.prompt_ids) + done,
            "prompt_tokens_details": {"cached_tokens": plan.cached_tokens}}


def whole_response(engine: Engine, plan: Plan, outputs: list[ChoiceOutput], rid: str, model: str) -> dict[str, Any]:
    """The non-streamed chat.completion or text_completion object."""
    req = plan.request
    choices: list[dict[str, Any]] = []
    for i, o in enumerate(outputs):
        if req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(o.content) or None,
                                       "reasoning_content": "".join(o.reasoning) or None}
            if o.calls:
                message["tool_calls"] = [_call_object(c) for c in o.calls]
            lp = chat_logprobs(engine, o.logprobs) if req.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": o.finish_reason})
        else:
            lp = completion_logprobs(engine, o.logprobs) if req.logprobs else None
            choices.append({"index": i, "text": "".join(o.content), "logprobs": lp, "finish_reason": o.finish_reason})
    kind = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(plan, outputs)}


def new_id(kind: str) -> str:
    """A response id: chatcmpl-… or cmpl-…."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class StreamWriter:
    """Builds the SSE chunks of one streamed request."""

    def __init__(self, engine: Engine, plan: Plan, rid: str, model: str) -> None:
        self.engine, self.plan, self.rid, self.model = engine, plan, rid, model
        self.chat = plan.request.kind == "chat"
        self.created = int(time.time())
        self.num_calls: dict[int, int] = {}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse({"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                     "choices": choices, **extra})

    def _choice(self, i: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> bytes:
        if self.chat:
            return self._chunk([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
        return self._chunk([{"index": i, "text": delta.get("content", ""), "logprobs": logprobs,
                             "finish_reason": finish}])

    def opening(self, i: int) -> bytes:
        """The first chunk of a choice (chat: the assistant role)."""
        return self._choice(i, {"role": "assistant", "content": ""}) if self.chat else b""

    def events(self, i: int, events: list[Event], lps: list[TokenLogprob]) -> list[bytes]:
        """SSE chunks for one round's events; the round's logprobs ride on its first chunk."""
        req = self.plan.request
        lp: Any = None
        if req.logprobs and lps:
            lp = chat_logprobs(self.engine, lps) if self.chat else completion_logprobs(self.engine, lps)
        out: list[bytes] = []
        for kind, value in events:
            if kind == "call":
                out += self._call(i, value)
            else:
                key = "reasoning_content" if kind == "reasoning" else "content"
                out.append(self._choice(i, {key: value}, lp if not out else None))
        if lp is not None and not out:
            out.append(self._choice(i, {"content": ""}, lp))
        return out

    def _call(self, i: int, call: ToolCall) -> list[bytes]:
        k = self.num_calls.get(i, 0)
        self.num_calls[i] = k + 1
        head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        out = [self._choice(i, {"tool_calls": [head]})]
        for piece in call.argument_pieces():
            out.append(self._choice(i, {"tool_calls": [{"index": k, "function": {"arguments": piece}}]}))
        return out

    def closing(self, i: int, finish: str | None) -> bytes:
        """The last chunk of a choice: an empty delta with the finish reason."""
        return self._choice(i, {}, None, finish or "stop")

    def usage_chunk(self, outputs: list[ChoiceOutput]) -> bytes:
        """The final usage chunk (stream_options.include_usage)."""
        return self._chunk([], usage=usage(self.plan, outputs))


async def stream_body(writer: StreamWriter, job: Job, outputs: list[ChoiceOutput],
                      on_chunk: Any) -> AsyncIterator[bytes]:
    """The SSE body: every choice's chunks as rounds commit, usage, then [DONE]. Cancels the job if cut off."""
    try:
        opened: set[int] = set()
        async for kind, value in job.items():
            if kind == "chunk":
                i, chunk, t = value
                on_chunk(i, chunk, t)
                if i not in opened:
                    opened.add(i)
                    if head := writer.opening(i):
                        yield head
                for piece in writer.events(i, outputs[i].feed(chunk), chunk.logprobs):
                    yield piece
                if chunk.finish_reason is not None:
                    yield writer.closing(i, outputs[i].finish_reason)
        if writer.plan.request.include_usage:
            yield writer.usage_chunk(outputs)
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # mid-stream failure: the status line is sent, so report it in the stream
        from tandem.server.errors import APIError

        err = exc if isinstance(exc, APIError) else internal_error(exc, log)
        yield b"data: " + err.to_bytes() + b"\n\n"
    finally:
        job.cancel()
