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
    means "off"; ``cache_options`` its cache keyword arguments (tandem/cli.py ``cache_options``)."""
    return Engine.from_pretrained(model, device=device, max_context=max_context, progress=True,
                                  spec=spec or "off", **(cache_options or {}))


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


async def _serve(app: Any, sock: socket.socket, graceful_s: float, header_timeout_s: float = 30.0) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.graceful_timeout = graceful_s
    config.accesslog = None
    # Hypercorn's idle timer runs from a connection's start (or its last response) until a request's headers are
    # complete: it is the header deadline as well as the keep-alive. Its read_timeout would also cut a client
    # waiting quietly for a long answer, so it stays off; the body has its own deadline (app.read_body).
    config.keep_alive_timeout = header_timeout_s
    stop = asyncio.Event()
    state = app.state.tandem

    async def drain() -> None:
        await state.scheduler.drain()
        stop.set()

    def on_term() -> None:
        if not state.scheduler.draining:
            print("tandem: draining (SIGTERM): new requests get 503", file=sys.stderr, flush=True)
            asyncio.ensure_future(drain())
        else:
            stop.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_term)
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, device: str = "auto",
          spec: str | None = None, max_queue: int = 8, queue_timeout_s: float = 60.0,
          max_context: int | None = None, served_name: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts: Sequence[str] = (),
          allowed_origins: Sequence[str] = (), header_timeout_s: float = 30.0,
          body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, options: ServerOptions | None = None,
          chat_template: str | None = None, cache_options: dict[str, Any] | None = None) -> int:
    """Run the server until SIGTERM / SIGINT; returns the exit status. ``chat_template``: a Jinja file that
    replaces the checkpoint's template."""
    t0 = time.perf_counter()
    sock = bind(host, port)  # before loading: a busy port is an error at once, not after a long load
    try:
        print(f"tandem: loading {model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
        engine = load_engine(model, device, max_context, spec, cache_options)
        if chat_template is not None:
            from pathlib import Path

            from tandem.chat import ChatTemplate

            special = engine.chat_template.special_tokens if engine.chat_template is not None else None
            engine.chat_template = ChatTemplate(Path(chat_template).read_text(encoding="utf-8"), special)
        warm = engine.warm_up()  # the device kernels compiled before the first request, not inside it
        if warm:
            print(f"tandem: device kernels ready in {warm:.1f} s", file=sys.stderr, flush=True)
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
        asyncio.run(_serve(app, sock, graceful_s=max(queue_timeout_s, 30.0), header_timeout_s=header_timeout_s))
    finally:
        with contextlib.suppress(OSError):  # Hypercorn closes the socket it was handed
            sock.close()
    return 0
