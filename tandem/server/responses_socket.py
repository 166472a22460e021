"""The Responses API's WebSocket mode: one connection to `/v1/responses`, `response.create` messages, each answered
by the same events a streamed HTTP response sends, one JSON text message each.

- The key is checked on the upgrade (the HTTP routes' keys and tenants; a refused upgrade answers 401 / 403 in
  OpenAI's error shape where the server can send a response, else closes with 1008).
- Turns run one after the other, in the order their messages came; each goes through the server's scheduler as an
  HTTP request would (the same queue, limits and 503s), and closing the socket cancels the turn that runs. A client
  with more messages waiting than --max-queue is disconnected (1013, try again later).
- `previous_response_id` continues the connection's most recent response, `store: false` or not, for the socket's
  life (a connection-local cache of one response), else a stored one (the server's store); else the turn fails with
  `previous_response_not_found`. A turn that fails forgets the response it continued, so a retry of that
  continuation fails the same way (start a new chain, e.g. from a compaction's output).
- A failure before a response starts is `{type: error, status, error: {type, code, message, param}}` (Open
  Responses' WebSocket error event, OpenAI's error object); once it has started, the stream's error event.
- `stream`, `stream_options` (always streamed) are ignored; `background` is refused.
Reference: OpenAI's WebSocket mode (platform.openai.com/docs/guides/websocket-mode) and Open Responses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from tandem.server.errors import APIError, internal_error, invalid
from tandem.server.protocol import decode_body
from tandem.server.reqlog import RequestRecord
from tandem.server.responses_events import error_fields
from tandem.server.responses_store import ResponseStore
from tandem.server.responses_turn import TurnRun, prepare_turn, store_response
from tandem.server.state import error_response
from tandem.server.tenants import check_tenant

if TYPE_CHECKING:
    from tandem.server.state import ServerState

log = logging.getLogger("tandem.server")
ROUTE = "responses_ws"  # the metrics' and the log line's route name for a WebSocket turn


class _Client:
    """The connection as a drive.Connection: gone once the socket has closed."""

    def __init__(self) -> None:
        self.closed = False

    async def is_disconnected(self) -> bool:
        """True once the client has closed the socket."""
        return self.closed


async def _deny(websocket: WebSocket, err: APIError) -> None:
    """Refuse the upgrade: the error as an HTTP response where the server supports it, else close 1008."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error_response(err))
    else:
        await websocket.close(code=1008, reason=err.message[:120])


async def responses_socket(websocket: WebSocket, state: ServerState) -> None:
    """Serve one WebSocket connection on /v1/responses until the client closes it."""
    try:
        tenant = check_tenant(websocket, state.options.tenants)
    except APIError as err:
        log.warning("%s %d: %s", ROUTE, err.status, err.message[:200])
        await _deny(websocket, err)
        return
    await websocket.accept()
    client = _Client()
    inbox: asyncio.Queue[str | APIError | None] = asyncio.Queue()
    reader = asyncio.create_task(_read(websocket, state, inbox, client))
    local = ResponseStore(1, state.options.max_stored_response_bytes)  # the connection's most recent response
    try:
        while (message := await inbox.get()) is not None:
            await _turn(websocket, state, message, client, local, tenant)
    except (WebSocketDisconnect, RuntimeError, OSError):  # the client went while a turn was being sent
        client.closed = True
    finally:
        reader.cancel()


async def _read(websocket: WebSocket, state: ServerState, inbox: asyncio.Queue[str | APIError | None],
                client: _Client) -> None:
    """Queue the client's messages (a message over --max-body-mb is its turn's 413) until it closes."""
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            text = message.get("text")
            if text is None and message.get("bytes") is not None:
                text = bytes(message["bytes"]).decode("utf-8", "replace")
            if text is None:
                continue
            if inbox.qsize() > state.scheduler.max_queue:  # more waiting turns than the server queues at all
                await websocket.close(code=1013, reason="too many response.create messages waiting")
                break
            if len(text) > state.max_body_bytes:
                inbox.put_nowait(APIError(413, f"the message is {len(text)} characters; the limit is "
                                               f"{state.max_body_bytes}", code="body_too_large"))
                continue
            inbox.put_nowait(text)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        client.closed = True
        inbox.put_nowait(None)


def _create_body(message: str | APIError) -> dict[str, Any]:
    """The Responses body of a `response.create` message. Raises APIError 400 (or the reader's 413)."""
    if isinstance(message, APIError):
        raise message
    obj = decode_body(message.encode("utf-8", "surrogatepass"))
    if obj.get("type") != "response.create":
        raise invalid("type", "a message must be {\"type\": \"response.create\", ...}, got type "
                              f"{str(obj.get('type'))[:80]!r}")
    if obj.get("background"):
        raise invalid("background", "'background' responses are not supported over a WebSocket")
    return {k: v for k, v in obj.items() if k not in ("type", "stream", "stream_options", "background")}


async def _turn(websocket: WebSocket, state: ServerState, message: str | APIError, client: _Client,
                local: ResponseStore, tenant: str | None) -> None:
    """One response.create message: its events, or its error event; the connection's cache updated."""
    record = RequestRecord(ROUTE)
    record.tenant = tenant
    record.body_bytes = len(message) if isinstance(message, str) else 0
    prev: Any = None

    def history(rid: str) -> list[dict[str, Any]]:
        return local.get(rid) if rid in local else state.response_store.get(rid)

    def remember(run: TurnRun) -> None:
        local.put(run.rid, run.conversation())
        store_response(state, run)

    status = 200
    try:
        body = _create_body(message)
        prev = body.get("previous_response_id")
        turn = await prepare_turn(state, body, record, history)
        run = TurnRun(state, turn, record, remember)
        await run.start(client)
        async for event in run.events():
            await websocket.send_text(orjson.dumps(event).decode())
        if run.error is not None:
            status = run.error.status
    except APIError as err:
        status = err.status
        await websocket.send_text(orjson.dumps({"type": "error", "status": err.status,
                                                **error_fields(err)}).decode())
        if 400 <= err.status < 500:
            log.warning("%s %d: %s%s", ROUTE, err.status, f"{err.param}: " if err.param else "",
                        err.message[:200].encode("unicode_escape").decode("ascii"))
    except Exception as exc:  # never silent: the client reads that it failed, the log has why
        if client.closed or isinstance(exc, WebSocketDisconnect):
            raise
        failure = internal_error(exc, log)
        status = failure.status
        await websocket.send_text(orjson.dumps({"type": "error", "status": 500, **error_fields(failure)}).decode())
    finally:
        if status != 200 and isinstance(prev, str):
            local.discard(prev)  # a failed continuation: the chain does not go on from here
        state.metrics.requests.labels(ROUTE, str(status)).inc()
        record.status = status
        record.done()
