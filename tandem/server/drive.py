"""What every generating route shares: server defaults applied to a request, its plan, admission, and the
per-chunk bookkeeping (metrics, the request's log line)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tandem.generation import GenerationChunk
from tandem.server.errors import APIError, quote
from tandem.server.image_urls import fetch_image_urls, image_urls
from tandem.server.ledger import row_of
from tandem.server.protocol import GenerationRequest
from tandem.server.reqlog import RequestRecord
from tandem.server.responses import ChoiceOutput, Event
from tandem.server.runner import Plan, make_plan, make_work
from tandem.server.scheduler import Job
from tandem.server.tenants import tenant_salt

if TYPE_CHECKING:
    from tandem.server.state import ServerState


def prepare(state: ServerState, req: GenerationRequest, record: RequestRecord) -> Plan:
    """Check the model name, apply the server's defaults (template kwargs, seed, thinking budget, reasoning format) and
    build the plan. Raises APIError 404 (unknown model) or 400 (bad prompt, grammar)."""
    if req.model is not None and req.model not in (state.served_name, state.engine.name):
        raise APIError(404, f"the model {quote(req.model)} does not exist; this server serves "
                            f"'{state.served_name}'", param="model", code="model_not_found")
    opts = state.options
    req.cache_salt = tenant_salt(req.cache_salt, record.tenant)  # a tenant's own namespace unless it names one
    req.chat_template_kwargs = {**opts.default_template_kwargs, **req.chat_template_kwargs}
    if req.params.seed is None and opts.seed is not None:
        req.params.seed = opts.seed
    plan = make_plan(state.engine, state.compiler, req, opts.reasoning_budget)
    plan.inline_reasoning = opts.reasoning_format == "content"
    record.prompt_tokens = len(plan.prompt_ids)
    record.ignored = list(req.ignored)
    if opts.log_prompts and state.engine.tokenizer is not None:
        record.prompt = state.engine.tokenizer.decode(plan.prompt_ids)
    state.metrics.prompt_tokens.inc(len(plan.prompt_ids))
    return plan


async def plan_in_thread(state: ServerState, parse: Callable[[], GenerationRequest], record: RequestRecord
                         ) -> tuple[GenerationRequest, Plan]:
    """``parse()`` then ``prepare`` in the server's prep threads (the lane of the body's size: ServerState.lane),
    off the event loop: parsing, template rendering,
    tokenizing and grammar compiling are a request's CPU work before it queues (bounded by the body size), and the
    loop keeps answering the others meanwhile. A request that names image URLs (``--allow-image-urls``) leaves the
    lane between the two steps while its images are fetched (image_urls.py: the fetch threads, never a prep
    thread). Raises what ``parse`` and ``prepare`` raise (APIError 4xx), and a failed fetch's APIError 400."""
    lane = state.lane(record.body_bytes)
    small = lane is state.prep

    def then_prepare(req: GenerationRequest) -> Plan:
        if not small:  # again between the steps: a small request that came meanwhile goes first
            state.wait_for_small()
        return prepare(state, req, record)

    def work() -> tuple[GenerationRequest, Plan | None]:
        if not small:
            state.wait_for_small()
        req = parse()
        if image_urls(req):
            return req, None  # prepared after the fetches
        return req, then_prepare(req)

    if small:
        state.small_started()
        record.small = True
    try:
        loop = asyncio.get_running_loop()
        req, plan = await loop.run_in_executor(lane, work)
        if plan is None:
            await fetch_image_urls(state, req)
            plan = await loop.run_in_executor(lane, then_prepare, req)
        return req, plan
    except BaseException:
        if small:
            record.small = False
            state.small_done()
        raise


class _then:
    """`work(job)`, then `after()` however it ended (thread-safe `after`: ServerState.small_done)."""

    def __init__(self, work: Callable[[Job], None], after: Callable[[], None]) -> None:
        self.work, self.then = work, after

    def __call__(self, job: Job) -> None:
        try:
            self.work(job)
        finally:
            self.then()


class Connection(Protocol):
    """What a request's work watches for its client: an HTTP request, or a WebSocket turn
    (responses_socket.py)."""

    async def is_disconnected(self) -> bool:
        """True once the client has gone."""
        ...


async def _watch_disconnect(request: Connection, job: Job) -> None:
    """Cancel ``job`` once the client has gone (polled every 0.2 s until the job ends or is cancelled)."""
    while not job.cancelled():
        if await request.is_disconnected():
            job.cancel()
            return
        await asyncio.sleep(0.2)


class Tracker:
    """Per-request bookkeeping over its chunks: TTFT, decode speed, inter-token latency, speculation counts, and
    vLLM's request metrics when the last choice finishes; the request's live activity entry (from now until its
    response ends) and its ledger row (written when the record is done)."""

    def __init__(self, state: ServerState, plan: Plan, record: RequestRecord) -> None:
        self.state, self.plan, self.record = state, plan, record
        record.model = state.served_name
        self.live = state.activity.open(record.route, record.tenant, len(plan.prompt_ids), record.arrived)
        self._reply: list[str] | None = [] if state.options.log_prompts else None
        record.sinks.append(self._done)
        self.first_at: dict[int, float] = {}
        self.last_at: dict[int, float] = {}
        self.num_tokens: dict[int, int] = {}
        self.queue_s = 0.0
        self.num_finished = 0
        self.cached_tokens = 0
        tok = state.engine.tokenizer
        self.think_end = tok.token_id("</think>") if tok is not None else None
        self.reasoning_tokens: dict[int, int] = {}
        self.reasoning_open: dict[int, bool] = {}
        self._watcher: asyncio.Task[None] | None = None

    async def submit(self, request: Connection) -> Job:
        """Wait for the engine (503 when the queue is full or the wait too long) and start the work. A request whose
        client has gone while it waits is dropped before it starts (the scheduler's 503 "abandoned"); from here on a
        watcher cancels the job when the client goes (``stop_watching`` ends it: a streaming response watches for
        itself, a whole response once it is read)."""
        t0 = time.perf_counter()
        job = Job(asyncio.get_running_loop())
        self._watcher = asyncio.create_task(_watch_disconnect(request, job))
        work = make_work(self.state.engine, self.state.compiler, self.plan)
        if self.record.small:  # big-lane preparations wait until this small request's work has ended
            self.record.small = False
            work = _then(work, self.state.small_done)
        try:
            await self.state.scheduler.submit(job, work, request.is_disconnected)
        except BaseException:
            self.stop_watching()
            if isinstance(work, _then):
                self.state.small_done()  # it never ran
            raise
        self.queue_s = self.record.queue_s = time.perf_counter() - t0
        if self.live is not None:
            self.live.admitted_at = t0 + self.queue_s
        return job

    def _done(self, record: RequestRecord) -> None:
        """The record's sink: the request leaves the live activity; its ledger row is queued."""
        self.state.activity.close(self.live)
        ledger = self.state.ledger
        if ledger is not None:
            if self._reply is not None:
                record.reply = "".join(self._reply)
            ledger.add(row_of(record, time.time()))

    def stop_watching(self) -> None:
        """End the disconnect watcher started by ``submit`` (idempotent)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def on_chunk(self, i: int, chunk: GenerationChunk, t: float, finish_reason: str | None = None) -> None:
        """Record one chunk of choice `i` (`finish_reason`: the reason the API reports, when it differs)."""
        m, rec, n = self.state.metrics, self.record, len(chunk.token_ids)
        m.tokens_per_round.observe(n)
        m.generated_tokens.inc(n)
        self.cached_tokens = self.plan.cached_tokens  # set by the work before its first chunk (runner.make_work)
        stats = chunk.stats
        m.observe_round(n, stats.num_nodes if stats is not None else None,
                        t - self.last_at[i] if i in self.last_at else None)
        self.last_at[i] = t
        self.num_tokens[i] = self.num_tokens.get(i, 0) + n
        self._count_reasoning(i, chunk.token_ids)
        rec.completion_tokens += n
        live = self.live
        if live is not None:
            live.slot, live.cached_tokens = self.plan.slot, self.plan.cached_tokens
        self.state.activity.on_chunk(live, n, stats, t)
        if i == 0:
            if stats is not None:
                rec.num_rounds += 1
                rec.round_tokens += n
                if stats.num_nodes > 1:
                    rec.num_drafted += stats.num_nodes - 1
                    rec.num_accepted += max(0, n - 1)
            if self._reply is not None:
                self._reply.append(chunk.text)
        if i not in self.first_at:
            self.first_at[i] = t
            if i == 0:
                rec.ttft_s = t - rec.arrived
                m.ttft.observe(rec.ttft_s)
        if chunk.finish_reason is None:
            return
        if t > self.first_at[i]:
            speed = (self.num_tokens[i] - 1) / (t - self.first_at[i])
            m.tokens_per_s.observe(speed)
            rec.tokens_per_s = speed if i == 0 else rec.tokens_per_s
        rec.finish_reason = finish_reason or chunk.finish_reason
        rec.cached_tokens = self.cached_tokens
        rec.slot = self.plan.slot
        rec.cache_tier = self.plan.cache_tier
        self.num_finished += 1
        if self.num_finished == self.plan.request.n:
            self.stop_watching()
            self.state.activity.finish(self.live, rec.finish_reason)
            m.observe_request(t - rec.arrived, rec.ttft_s, self.queue_s, len(self.plan.prompt_ids),
                              rec.finish_reason)

    def _count_reasoning(self, i: int, ids: list[int]) -> None:
        if not self.reasoning_open.setdefault(i, self.plan.in_reasoning):
            return
        for k, t in enumerate(ids):
            if t == self.think_end:
                self.reasoning_tokens[i] = self.reasoning_tokens.get(i, 0) + k
                self.reasoning_open[i] = False
                return
        self.reasoning_tokens[i] = self.reasoning_tokens.get(i, 0) + len(ids)


async def single_choice(tracker: Tracker, job: Job, output: ChoiceOutput
                        ) -> AsyncIterator[tuple[list[Event], GenerationChunk]]:
    """The events of a one-choice request, chunk by chunk (fed to `output`, recorded by `tracker`). The job is
    cancelled when the consumer stops early (a client gone)."""
    try:
        async for kind, value in job.items():
            if kind != "chunk":
                continue
            i, chunk, t = value
            events = output.feed(chunk)
            tracker.on_chunk(i, chunk, t, output.finish_reason)
            yield events, chunk
    finally:
        job.cancel()


T = TypeVar("T")
KEEPALIVE_S = 10.0  # a stream silent this long (a long prefill) sends a keep-alive event


async def with_keepalive(source: AsyncIterator[T], interval_s: float = KEEPALIVE_S) -> AsyncIterator[T | None]:
    """`source`'s items, and None whenever `interval_s` seconds pass without one, so a stream can send a ping while
    a long prompt is prefilled (clients and proxies drop a stream that is silent for minutes). The pending read
    is never cancelled by a tick; closing this generator closes `source`."""
    it = source.__aiter__()
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
