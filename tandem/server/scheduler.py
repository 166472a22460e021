"""Admission: up to `slots` requests run at once (the engine's sequence slots, tandem/slots.py), a bounded queue
behind them, and a worker thread per admitted request.

Requests wait (asyncio) for a free slot: with `slots` = 4 and `max_queue` = 8, four requests run and up to eight
wait; a ninth waiter, or a wait past the timeout, answers 503 with Retry-After. A waiting request whose client has gone (its `Job` is
cancelled) leaves the queue at once and never reaches the engine. The admitted request's work runs in a thread
(the engine is synchronous and CPU-bound) and hands its items to the event loop through a thread-safe call; the
slot is released when the work ends, not when the client leaves, so a cancelled request frees its slot at its next
round (or between two prefill pieces) and nothing leaks.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandem.server.errors import APIError
from tandem.server.metrics import Metrics


class Job:
    """One request's link to the engine: the items its work emits, and its cancel flag.

    Built on the event loop thread; ``cancel`` is called there too, ``emit`` and ``cancelled`` from any thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._cancel = threading.Event()
        self.gone = asyncio.Event()  # set with the cancel flag: wakes a request waiting in the queue

    def emit(self, kind: str, value: Any = None) -> None:
        """Thread-safe: hand an item to the async side."""
        self._loop.call_soon_threadsafe(self._items.put_nowait, (kind, value))

    def cancelled(self) -> bool:
        """The engine's `cancelled` callable: True once the client has gone."""
        return self._cancel.is_set()

    def fail(self, err: BaseException) -> None:
        """End the request now with `err` (its stream sends its API's error event) and stop the work at its next
        round. Event-loop thread only."""
        self._items.put_nowait(("error", err))
        self.cancel()

    def cancel(self) -> None:
        """Ask the work to stop at its next round (or never start, while it waits). Event-loop thread only."""
        self._cancel.set()
        self.gone.set()

    async def items(self) -> AsyncIterator[tuple[str, Any]]:
        """The work's items until it ends; an exception raised by the work is re-raised here."""
        while True:
            kind, value = await self._items.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield kind, value


@dataclass
class _Waiter:
    turn: asyncio.Future[None]  # resolved when the engine is handed to this request
    job: Job
    disconnected: Callable[[], Awaitable[bool]] | None


class Scheduler:
    """Admission control for one engine: up to `slots` requests run, at most `max_queue` wait in arrival order.

    Args:
        max_queue: requests allowed to wait while every slot is busy (the running ones are not counted).
        queue_timeout_s: the longest wait before a 503.
        metrics: updated with queue depth, running count, starts and rejections.
        slots: requests that run at once (the engine's ``parallel``), at least 1.
    """

    def __init__(self, max_queue: int, queue_timeout_s: float, metrics: Metrics, slots: int = 1) -> None:
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics
        self.slots = max(1, int(slots))
        self.num_running = 0
        self.draining = False
        self.aborted: APIError | None = None
        self._running: set[Job] = set()
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine."""
        return len(self._waiters)

    def _busy(self, reason: str, message: str) -> APIError:
        self.metrics.rejected.labels(reason).inc()
        return APIError(503, message, code=reason, retry_after_s=max(1, int(self.queue_timeout_s // 4) or 1))

    async def submit(self, job: Job, work: Callable[[Job], None],
                     disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Wait for a free slot, then start `work(job)` in a thread.

        Raises: APIError 503 (queue full, timeout, draining; code "abandoned" when `job` is cancelled before it
        starts: the client has gone, and the work never runs).
        """
        if self.draining:
            raise self._busy("draining", "the server is shutting down")
        if self.num_running >= self.slots or self._waiters:  # arrival order: nobody passes a waiter
            await self._wait(job, disconnected)
        else:
            self.num_running += 1
        if not job.cancelled() and disconnected is not None and await disconnected():
            job.cancel()
        if job.cancelled():  # gone while it waited, or before it came: hand the slot on unused
            self._release()
            raise self._busy("abandoned", "the client closed the request before it started")
        if self.aborted is not None:
            self._release()
            raise self.aborted
        self.metrics.running.set(self.num_running)
        self.metrics.started.inc()
        self._running.add(job)
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._run, args=(job, work, loop), daemon=True, name="tandem-engine").start()

    async def _wait(self, job: Job, disconnected: Callable[[], Awaitable[bool]] | None) -> None:
        """Queue until `_release` hands a slot over (its count moves with it), or fail."""
        if self.num_waiting >= self.max_queue:
            await self._evict_gone()
        if self.num_waiting >= self.max_queue:
            raise self._busy("queue_full", f"the queue is full ({self.max_queue} waiting); retry later")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(turn, job, disconnected)
        self._waiters.append(waiter)
        self.metrics.queue_depth.set(self.num_waiting)
        gone: asyncio.Future[Any] = asyncio.ensure_future(job.gone.wait())
        try:
            await asyncio.wait([turn, gone], timeout=self.queue_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not turn.done():
                turn.cancel()
                self._waiters.remove(waiter)
            self.metrics.queue_depth.set(self.num_waiting)
        if turn.cancelled():
            if self.aborted is not None:
                raise self.aborted
            if job.cancelled():
                raise self._busy("abandoned", "the client closed the request while it waited")
            raise self._busy("queue_timeout", f"waited {self.queue_timeout_s:g} s for the engine")

    async def _evict_gone(self) -> None:
        """Before refusing a request for a full queue: drop the waiters whose clients have gone since their
        watchers last looked (their own tasks then answer "abandoned")."""
        for waiter in list(self._waiters):
            if waiter.disconnected is not None and not waiter.turn.done() and await waiter.disconnected():
                waiter.job.cancel()
                waiter.turn.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.metrics.queue_depth.set(self.num_waiting)

    def _run(self, job: Job, work: Callable[[Job], None], loop: asyncio.AbstractEventLoop) -> None:
        try:
            if not job.cancelled():
                work(job)
        except BaseException as exc:  # handed to the request; the thread itself must not die silently
            job.emit("error", exc)
        finally:
            job.emit("end")
            loop.call_soon_threadsafe(self._release, job)

    def _release(self, job: Job | None = None) -> None:
        """A slot is free: hand it to the first waiter, else count it idle."""
        self._running.discard(job)
        while self._waiters:
            turn = self._waiters.popleft().turn
            if not turn.done():
                turn.set_result(None)
                self.metrics.queue_depth.set(self.num_waiting)
                return
        self.num_running = max(0, self.num_running - 1)
        self.metrics.running.set(self.num_running)

    async def drain(self) -> None:
        """Refuse new requests and wait until the ones admitted or waiting have finished."""
        self.draining = True
        while self.num_running or self.num_waiting:
            await asyncio.sleep(0.05)

    def abort(self, err: APIError) -> None:
        """End every request now: the running ones fail with `err` (a stream sends its API's error event) and their
        work stops at its next round; the waiting ones are answered `err`; new ones too (draining)."""
        self.draining = True
        self.aborted = err
        for job in list(self._running):
            job.fail(err)
        for waiter in list(self._waiters):
            waiter.job.cancel()
            if not waiter.turn.done():
                waiter.turn.cancel()
        self._waiters.clear()
        self.metrics.queue_depth.set(0)
