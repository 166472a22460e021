"""One Responses API turn, whatever carries it (an HTTP request, whole or streamed, or a WebSocket message): the body
parsed into a chat request and its plan, the engine's work admitted, and the response's events as the rounds commit.

A turn whose input ends with a `{type: compaction_trigger}` item is a compaction (responses_compact.py): the model
writes the conversation's summary and the response's one output item is the `compaction` item holding it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.server.agent_request import EFFORT_BUDGETS
from tandem.server.api_rules import check_responses
from tandem.server.drive import Connection, Tracker, plan_in_thread, single_choice, with_keepalive
from tandem.server.errors import APIError, internal_error, invalid
from tandem.server.protocol import GenerationRequest, decode_body, parse_chat, shown_names
from tandem.server.reqlog import RequestRecord
from tandem.server.responses import ChoiceOutput
from tandem.server.responses_compact import compacted_conversation, compaction_chat_body
from tandem.server.responses_events import ResponseBuilder, new_id
from tandem.server.responses_request import split_trigger, to_chat_body
from tandem.server.runner import Plan

if TYPE_CHECKING:
    from tandem.server.state import ServerState

log = logging.getLogger("tandem.server")

History = Callable[[str], list[dict[str, Any]]]  # previous_response_id -> its conversation (APIError 400 if unknown)


@dataclass
class Turn:
    """A parsed and planned turn.

    Attributes:
        body: the Responses body (echoed in the response object).
        req: the chat request it became; plan: its plan.
        conversation: the chat messages up to this turn's input (what the store keeps, with the output).
        compaction: the input ended with a compaction_trigger item.
    """

    body: dict[str, Any]
    req: GenerationRequest
    plan: Plan
    conversation: list[dict[str, Any]]
    compaction: bool


def chat_request(state: ServerState, body: dict[str, Any], history: History
                 ) -> tuple[GenerationRequest, list[dict[str, Any]], bool]:
    """(chat request, conversation, compaction) of a Responses body. Raises APIError 400 naming the bad field (or
    previous_response_not_found)."""
    check_responses(body)  # the Responses API's own ranges and enums (api_rules.py)
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise invalid("previous_response_id", "'previous_response_id' must be a string")
    body, compaction = split_trigger(body)
    conversation = history(prev) if prev else []
    default = EFFORT_BUDGETS["medium"] if state.options.reasoning_budget is None else None
    chat_body, conversation, ignored = to_chat_body(body, conversation, state.options.strict_fields, default,
                                                    state.allow_image_urls)
    if compaction:
        chat_body = compaction_chat_body(chat_body, state.engine.max_context)
    req = parse_chat(chat_body, strict=True, allow_image_urls=state.allow_image_urls)
    req.ignored = shown_names(ignored)
    return req, conversation, compaction


async def prepare_turn(state: ServerState, raw: bytes | dict[str, Any], record: RequestRecord,
                       history: History) -> Turn:
    """Parse and plan a turn in the server's preparation threads (drive.plan_in_thread). `raw`: the body's bytes,
    or its object (a WebSocket message). Raises APIError 4xx."""
    parsed: list[tuple[dict[str, Any], list[dict[str, Any]], bool]] = []

    def parse() -> GenerationRequest:
        body = decode_body(raw) if isinstance(raw, bytes) else raw
        req, conversation, compaction = chat_request(state, body, history)
        parsed.append((body, conversation, compaction))
        return req

    req, plan = await plan_in_thread(state, parse, record)
    body, conversation, compaction = parsed[0]
    return Turn(body, req, plan, conversation, compaction)


class TurnRun:
    """The engine's work for one turn and the response's events.

    Args:
        state: the server's state.
        turn: the planned turn.
        record: the request's log record.
        remember: called with the run once the response is complete (the store keeps it), before the terminal
            event is sent.
    """

    def __init__(self, state: ServerState, turn: Turn, record: RequestRecord,
                 remember: Callable[[TurnRun], None]) -> None:
        self.state, self.turn, self.remember = state, turn, remember
        self.tracker = Tracker(state, turn.plan, record)
        self.output = ChoiceOutput(turn.plan)
        self.builder = ResponseBuilder(turn.body, new_id("resp"), state.served_name, turn.plan, self.tracker,
                                       state.options.responses_events)
        self.job: Any = None
        self.status = "in_progress"
        self.error: APIError | None = None

    @property
    def rid(self) -> str:
        """The response id."""
        return self.builder.rid

    async def start(self, connection: Connection) -> None:
        """Wait for the engine and start the work (APIError 503 when the queue is full or the wait too long; the
        work is cancelled when `connection` goes)."""
        self.job = await self.tracker.submit(connection)

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation after this response (what a later previous_response_id continues)."""
        if self.turn.compaction:
            return compacted_conversation(self.turn.conversation, self.summary(), keep_users=False)
        return self.turn.conversation + self.builder.conversation_tail()

    def summary(self) -> str:
        """A compaction's summary: the answer's text."""
        return "".join(self.output.content).strip()

    async def events(self, keepalive: bool = True) -> AsyncIterator[dict[str, Any]]:
        """response.created, response.in_progress, the output's events as rounds commit (and response.in_progress
        again every drive.KEEPALIVE_S while nothing comes, with `keepalive`), then response.completed or
        response.incomplete; on a failure an error event (and `error` is set)."""
        b = self.builder
        yield b.event("response.created", response=b.envelope("in_progress"))
        yield b.event("response.in_progress", response=b.envelope("in_progress"))
        try:
            source = single_choice(self.tracker, self.job, self.output)
            async for got in with_keepalive(source) if keepalive else source:
                if got is None:  # nothing yet (a long prefill): the in_progress event again keeps the stream alive
                    yield b.event("response.in_progress", response=b.envelope("in_progress", self.output))
                    continue
                if not self.turn.compaction:
                    for event in got[0]:
                        for piece in b.feed(event):
                            yield piece
            for piece in b.close() if not self.turn.compaction else b.compaction(self.summary()):
                yield piece
            self.status = "incomplete" if self.output.finish_reason == "length" and not self.turn.compaction \
                else "completed"
            self.remember(self)
            yield b.event(f"response.{self.status}", response=b.envelope(self.status, self.output))
        except Exception as exc:  # the stream has started: the failure is an event
            self.error = exc if isinstance(exc, APIError) else internal_error(exc, log)
            self.status = "failed"
            yield b.error(self.error)


def store_response(state: ServerState, run: TurnRun) -> None:
    """Keep a finished response in the server's store unless its request said `store: false`."""
    if run.turn.body.get("store") is not False:
        state.response_store.put(run.rid, run.conversation(), run.builder.envelope(run.status, run.output))
