"""`tandem serve`: load the engine, bind the socket, run Hypercorn; SIGTERM drains before exiting."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from tandem.engine import Engine
from tandem.server.app import create_app
from tandem.server.state import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from tandem.server.options import ServerOptions


def load_engine(model: str | None, device: str, max_context: int | None, spec: str | None,
                cache_options: dict[str, Any] | None = None) -> Engine:
    """Engine.from_pretrained with progress on stderr (a bar on a terminal, else throttled lines); ``spec`` None
    means "default" (the device's measured mode, speculator.default_mode); ``cache_options`` its cache keyword
    arguments (tandem/cli.py ``cache_options``)."""
    return Engine.from_pretrained(model, device=device, max_context=max_context, progress=True,
                                  spec=spec or "default", **(cache_options or {}))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: the OS picks one).

    Raises: ValueError naming the address when it cannot be bound (in use, not an address of this host, ...)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


DEFAULT_DRAIN_TIMEOUT_S = 60.0
EXIT_DRAINED, EXIT_DRAIN_TIMEOUT, EXIT_FORCED = 0, 3, 4  # the exit status says how the server ended
_FLUSH_S = 2.0  # after an abort: time for the open streams to send their error events before the sockets close


async def _serve(app: Any, sock: socket.socket, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 header_timeout_s: float = 30.0) -> int:
    """Hypercorn until a signal. The first SIGTERM / SIGINT drains (new requests 503; admitted and waiting ones
    finish) for at most `drain_timeout_s`; then, or at a second signal, every open request ends at once with a
    503 "shutdown" error (a stream: its API's error event). Returns EXIT_DRAINED, EXIT_DRAIN_TIMEOUT or
    EXIT_FORCED."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from tandem.server.errors import APIError

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.graceful_timeout = _FLUSH_S  # our own drain runs before Hypercorn is told to stop
    config.accesslog = None
    # Hypercorn's idle timer runs from a connection's start (or its last response) until a request's headers are
    # complete: it is the header deadline as well as the keep-alive. Its read_timeout would also cut a client
    # waiting quietly for a long answer, so it stays off; the body has its own deadline (app.read_body).
    config.keep_alive_timeout = header_timeout_s
    stop = asyncio.Event()
    state = app.state.tandem
    scheduler = state.scheduler
    status = [EXIT_DRAINED]

    async def abort(code: int, why: str) -> None:
        if status[0] != EXIT_DRAINED:
            return
        status[0] = code
        print(f"tandem: {why}: ending every open request now", file=sys.stderr, flush=True)
        scheduler.abort(APIError(503, "the server is shutting down", code="shutdown"))
        deadline = asyncio.get_running_loop().time() + _FLUSH_S
        while scheduler.num_running and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)  # the engine stops at its next round; the streams send their error events
        stop.set()

    async def drain() -> None:
        try:
            await asyncio.wait_for(scheduler.drain(), drain_timeout_s)
        except TimeoutError:
            await abort(EXIT_DRAIN_TIMEOUT, f"the drain passed --drain-timeout {drain_timeout_s:g} s")
        stop.set()

    def on_signal() -> None:
        if not scheduler.draining:
            print(f"tandem: draining (at most {drain_timeout_s:g} s; a second signal ends at once): new requests "
                  "get 503", file=sys.stderr, flush=True)
            asyncio.ensure_future(drain())
        else:
            asyncio.ensure_future(abort(EXIT_FORCED, "a second signal"))

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_signal)
    loop.add_signal_handler(signal.SIGINT, on_signal)
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)
    return status[0]


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, device: str = "auto",
          spec: str | None = None, max_queue: int = 8, queue_timeout_s: float = 60.0,
          max_context: int | None = None, served_name: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts: Sequence[str] = (),
          allowed_origins: Sequence[str] = (), header_timeout_s: float = 30.0,
          body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, options: ServerOptions | None = None,
          chat_template: str | None = None, cache_options: dict[str, Any] | None = None,
          drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, spec_max_running: int = 1) -> int:
    """Run the server until SIGTERM / SIGINT; returns the exit status: EXIT_DRAINED (0) when every request
    finished, EXIT_DRAIN_TIMEOUT (3) when ``drain_timeout_s`` cut the drain, EXIT_FORCED (4) at a second signal
    (`_serve`). ``chat_template``: a Jinja file that replaces the checkpoint's template. ``spec_max_running``:
    Engine.spec_max_running (slots drafting trees while at most this many run)."""
    t0 = time.perf_counter()
    sock = bind(host, port)  # before loading: a busy port is an error at once, not after a long load
    try:
        print(f"tandem: loading {model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
        engine = load_engine(model, device, max_context, spec, cache_options)
        engine.spec_max_running = spec_max_running
        if chat_template is not None:
            from pathlib import Path

            from tandem.chat import ChatTemplate

            special = engine.chat_template.special_tokens if engine.chat_template is not None else None
            engine.chat_template = ChatTemplate(Path(chat_template).read_text(encoding="utf-8"), special)
        warm = engine.warm_up()  # the device kernels compiled before the first request, not inside it
        if warm:
            print(f"tandem: device kernels ready in {warm:.1f} s", file=sys.stderr, flush=True)
        held = engine.slot_state_bytes()
        if held:
            print(f"tandem: {engine.parallel} slots (--parallel), their states {held / 2**30:.2f} GiB for "
                  f"{engine.max_context} tokens each", file=sys.stderr, flush=True)
        app = create_app(engine, served_name=served_name, max_queue=max_queue, queue_timeout_s=queue_timeout_s,
                         max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, bound_host=host,
                         allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, options=options)
    except BaseException:
        sock.close()
        raise
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/v1"
    print(f"tandem: serving {app.state.tandem.served_name} at {url} (loaded in {time.perf_counter() - t0:.1f} s)",
          flush=True)
    try:
        code = asyncio.run(_serve(app, sock, drain_timeout_s=drain_timeout_s, header_timeout_s=header_timeout_s))
    finally:
        with contextlib.suppress(OSError):  # Hypercorn closes the socket it was handed
            sock.close()
        app.state.tandem.close()
    return code
