"""What every route shares: the server's state (engine, scheduler, metrics, options, grammar compiler, prep
threads), JSON and error responses, and the bounded body reader. The route modules (app.py, anthropic.py,
responses_api.py, drive.py) import it; it imports none of them."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from tandem.engine import Engine
from tandem.server.activity import Activity
from tandem.server.cache_api import CacheCollector, SlotCollector
from tandem.server.errors import APIError
from tandem.server.grammar import GrammarCompiler
from tandem.server.ledger import Ledger, LedgerCollector
from tandem.server.metrics import Metrics
from tandem.server.options import ServerOptions
from tandem.server.responses_store import ResponseStore
from tandem.server.scheduler import Scheduler

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
PREP_THREADS = 2  # requests parsed, rendered, tokenized and compiled at once, off the event loop
BIG_BODY_BYTES = 64 * 1024  # a body past this is prepared in the big lane (one thread), never in the small one
BIG_WAIT_S = 2.0  # the longest a big-lane preparation waits for the small requests in flight


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response serialised by orjson."""
    return Response(orjson.dumps(obj), status_code=status, headers=headers, media_type="application/json")


def error_response(err: APIError) -> Response:
    """OpenAI's error shape with the error's status and headers."""
    return json_response(err.body(), err.status, err.headers())


class ServerState:
    """What the routes share: the engine, its scheduler, metrics, the live activity, the usage ledger (None when
    off) and the lazily built grammar compiler.

    Raises: LedgerError when ``options.ledger`` names a file that cannot be a ledger."""

    def __init__(self, engine: Engine, served_name: str, max_queue: int, queue_timeout_s: float,
                 max_body_bytes: int, options: ServerOptions | None = None,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.engine = engine
        self.served_name = served_name
        self.options = options or ServerOptions()
        self.response_store = ResponseStore(self.options.max_stored_responses,
                                            self.options.max_stored_response_bytes)
        self.metrics = Metrics(served_name)
        self.metrics.registry.register(CacheCollector(engine))
        self.metrics.registry.register(SlotCollector(engine))
        self.scheduler = Scheduler(max_queue, queue_timeout_s, self.metrics, engine.parallel)
        self.metrics.slots.set(engine.parallel)
        self.activity = Activity(self.options.activity)
        self.ledger = Ledger(self.options.ledger) if self.options.ledger else None
        if self.ledger is not None:
            self.metrics.registry.register(LedgerCollector(self.ledger))
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="tandem-prep")
        self.prep_big = ThreadPoolExecutor(1, thread_name_prefix="tandem-prep-big")
        self._small = 0  # small requests being prepared or waiting for their engine turn
        self._small_idle = threading.Condition()
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._fetch: ThreadPoolExecutor | None = None  # image URL fetches (image_urls.py), made at the first use
        self._fetch_lock = threading.Lock()

    def close(self) -> None:
        """Write the ledger's queued rows and stop its writer (at the server's exit)."""
        if self.ledger is not None:
            self.ledger.close()

    def lane(self, body_bytes: int) -> ThreadPoolExecutor:
        """The preparation threads for a request of `body_bytes`: bodies up to BIG_BODY_BYTES share the small lane
        (PREP_THREADS threads), bigger ones queue for the big lane's one thread, so however many huge bodies
        arrive (each bounded by --max-body-mb and the grammar and prompt-byte limits), a small request never
        waits behind them for a thread (tokenizing and grammar compiling release the GIL)."""
        return self.prep_big if body_bytes > BIG_BODY_BYTES else self.prep

    def small_started(self) -> None:
        """A small request entered preparation (`small_done` when it has its engine turn or failed)."""
        with self._small_idle:
            self._small += 1

    def small_done(self) -> None:
        """The counterpart of `small_started`."""
        with self._small_idle:
            self._small -= 1
            if self._small == 0:
                self._small_idle.notify_all()

    def wait_for_small(self, timeout_s: float = BIG_WAIT_S) -> None:
        """Hold a big-lane preparation while small requests are being prepared or wait for the engine, at most
        `timeout_s` (small ones go first, and a steady stream of them cannot starve a big one)."""
        with self._small_idle:
            self._small_idle.wait_for(lambda: self._small == 0, timeout_s)

    @property
    def allow_image_urls(self) -> bool:
        """Whether the engine fetches http(s) image URLs (``--allow-image-urls``): the parsers keep them, else
        refuse them with a 400 naming the part."""
        return self.engine.image_fetcher is not None

    def fetch_threads(self, num_threads: int) -> ThreadPoolExecutor:
        """The threads that fetch image URLs (``--allow-image-urls``; server/image_urls.py), apart from the
        preparation lanes so a slow image host delays only the requests that name it; made at the first use with
        ``num_threads`` threads."""
        with self._fetch_lock:
            if self._fetch is None:
                self._fetch = ThreadPoolExecutor(num_threads, thread_name_prefix="tandem-fetch")
            return self._fetch

    def compiler(self) -> GrammarCompiler:
        """The llguidance compiler for this engine's tokenizer (built on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                if self.engine.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer, so grammars are unavailable")
                self._compiler = GrammarCompiler(self.engine.tokenizer, self.engine.vocab_size,
                                                 self.engine.eos_token_ids)
            return self._compiler


async def read_body(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """The request body; APIError 413 past `limit` bytes (the rest is drained so the client reads the answer),
    APIError 408 when the whole body has not arrived within `timeout_s` seconds (a client trickling it)."""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size <= limit:
                    parts.append(part)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="body_timeout") from None
    record = getattr(request.state, "record", None)
    if record is not None:
        record.body_bytes = size  # picks the preparation lane (ServerState.lane)
    if size > limit:
        raise APIError(413, f"the request body is {size} bytes; the limit is {limit}", code="body_too_large")
    return b"".join(parts)
