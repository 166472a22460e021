"""One sequence at a time: a bounded queue in front of the engine, and a worker thread per admitted request.

Requests wait (asyncio) for the engine; a full queue or a wait past the timeout answers 503 with Retry-After.
The admitted request's work runs in a thread (the engine is synchronous and CPU-bound) and hands its items to the
event loop through a thread-safe call; the engine is released when the work ends, not when the client leaves, so
a cancelled request frees the engine at its next round and nothing leaks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.server.errors import APIError
from tandem.server.metrics import Metrics


class Job:
    """One admitted request: the items its work emits, and its cancel flag."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._cancel = threading.Event()

    def emit(self, kind: str, value: Any = None) -> None:
        """Thread-safe: hand an item to the async side."""
        self._loop.call_soon_threadsafe(self._items.put_nowait, (kind, value))

    def cancelled(self) -> bool:
        """The engine's `cancelled` callable: True once the client has gone."""
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the work to stop at its next round."""
        self._cancel.set()

    async def items(self) -> AsyncIterator[tuple[str, Any]]:
        """The work's items until it ends; an exception raised by the work is re-raised here."""
        while True:
            kind, value = await self._items.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield kind, value


class Scheduler:
    """Admission control for one engine.

    Args:
        max_queue: requests allowed to wait while the engine is busy.
        queue_timeout_s: the longest wait before a 503.
        metrics: updated with queue depth, running count and rejections.
    """

    def __init__(self, max_queue: int, queue_timeout_s: float, metrics: Metrics) -> None:
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics
        self.num_waiting = 0
        self.num_running = 0
        self.draining = False
        self._lock: asyncio.Lock | None = None

    def _busy(self, reason: str, message: str) -> APIError:
        self.metrics.rejected.labels(reason).inc()
        return APIError(503, message, code=reason, retry_after_s=max(1, int(self.queue_timeout_s // 4) or 1))

    async def submit(self, work: Callable[[Job], None]) -> Job:
        """Wait for the engine, then start `work(job)` in a thread. Raises APIError 503 (full, timeout, draining)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self.draining:
            raise self._busy("draining", "the server is shutting down")
        if self.num_waiting >= self.max_queue:
            raise self._busy("queue_full", f"the queue is full ({self.max_queue} waiting); retry later")
        self.num_waiting += 1
        self.metrics.queue_depth.set(self.num_waiting)
        try:
            await asyncio.wait_for(self._lock.acquire(), self.queue_timeout_s)
        except TimeoutError:
            raise self._busy("queue_timeout", f"waited {self.queue_timeout_s:g} s for the engine") from None
        finally:
            self.num_waiting -= 1
            self.metrics.queue_depth.set(self.num_waiting)
        loop = asyncio.get_running_loop()
        job = Job(loop)
        self.num_running += 1
        self.metrics.running.set(self.num_running)
        threading.Thread(target=self._run, args=(job, work, loop), daemon=True, name="tandem-engine").start()
        return job

    def _run(self, job: Job, work: Callable[[Job], None], loop: asyncio.AbstractEventLoop) -> None:
        try:
            work(job)
        except BaseException as exc:  # handed to the request; the thread itself must not die silently
            job.emit("error", exc)
        finally:
            job.emit("end")
            loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        assert self._lock is not None
        self.num_running -= 1
        self.metrics.running.set(self.num_running)
        self._lock.release()

    async def drain(self) -> None:
        """Refuse new requests and wait until the ones admitted or waiting have finished."""
        self.draining = True
        while self.num_running or self.num_waiting:
            await asyncio.sleep(0.05)
