"""The bounded in-memory store of recent Responses API responses: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns (the server's store), and the one most recent response of a WebSocket connection."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import orjson

from tandem.server.errors import APIError


class ResponseStore:
    """The last stored responses: id -> what `previous_response_id` needs (the conversation as chat messages, up to
    and including the output) and what `GET /v1/responses/{id}` returns (the response object), kept as compact JSON
    bytes. At most `capacity` responses and `max_bytes` bytes; the oldest is dropped first, and a response larger
    than `max_bytes` is not kept. Thread-safe.

    Args:
        capacity: the most responses kept (0: none).
        max_bytes: the most bytes kept, all responses together.
    """

    def __init__(self, capacity: int, max_bytes: int = 64 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict[str, Any]], response: dict[str, Any] | None = None) -> None:
        """Keep `messages` (and the response object) under `rid`, dropping the oldest past the bounds."""
        data = orjson.dumps({"messages": messages, "response": response})
        if self.capacity <= 0 or len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(rid, None)
            self.num_bytes += len(data) - (len(old) if old is not None else 0)
            self._items[rid] = data
            while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
                self.num_bytes -= len(self._items.popitem(last=False)[1])

    def discard(self, rid: str) -> None:
        """Forget `rid` (nothing when it is not kept)."""
        with self._lock:
            data = self._items.pop(rid, None)
            if data is not None:
                self.num_bytes -= len(data)

    def __contains__(self, rid: object) -> bool:
        with self._lock:
            return rid in self._items

    def __len__(self) -> int:
        return len(self._items)

    def _find(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            data = self._items.get(rid)
        return orjson.loads(data) if data is not None else None

    def get(self, rid: str) -> list[dict[str, Any]]:
        """The conversation of `rid`. Raises APIError 400 when it is not kept."""
        found = self._find(rid)
        if found is None:
            raise APIError(400, f"previous_response_id {rid[:80]!r} is not kept by this server (it keeps the last "
                                f"{self.capacity} stored responses, at most {self.max_bytes} bytes, in memory)",
                           param="previous_response_id", code="previous_response_not_found")
        return list(found["messages"])

    def response(self, rid: str) -> dict[str, Any]:
        """The response object of `rid`. Raises APIError 404 when it is not kept."""
        found = self._find(rid)
        if found is None or found["response"] is None:
            raise APIError(404, f"no stored response with id {rid[:80]!r} (responses with store false, and the "
                                "oldest past the store's bounds, are not kept)", code="not_found")
        return dict(found["response"])
