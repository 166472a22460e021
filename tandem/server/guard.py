"""What a web page cannot make the server do: the Host, Origin and Content-Type checks in front of every route.

A page the user visits can send "simple" requests to a loopback server (a text/plain POST needs no CORS
preflight), and with DNS rebinding its own host name can come to point at 127.0.0.1 so that it reads the answers.
So, as an ASGI middleware before any route:
- the Host header must name the bound address, `localhost`, `127.0.0.1`, `[::1]` or one of `allowed_hosts`
  (any port; "*" allows every host): else 403 code "host_not_allowed" (400 "missing_host" without one);
- a request carrying an Origin header must come from one of `allowed_origins` ("*": any) or from the server's own
  origin (the Origin's host and port are the Host header's, which passed the check above: the /dashboard page's
  module scripts and reads): else 403 "origin_not_allowed" (no CORS headers are sent unless origins are allowed:
  serve.py adds Starlette's CORSMiddleware for them);
- a POST must say Content-Type application/json (or a +json type): else 415 "unsupported_media_type".
A WebSocket upgrade (the Responses API's WebSocket mode) passes the Host and Origin checks too (a page may open a
socket to any address): a refused one is answered with the error as an HTTP response where the server supports
it, else closed before it is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tandem.server.errors import APIError, quote

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def host_name(host: str) -> str:
    """A Host header or bind address without its port, lower case, IPv6 in brackets, no trailing dot."""
    h = host.strip().lower()
    if h.startswith("["):
        h = h[:h.find("]") + 1] if "]" in h else h
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    elif h.count(":") > 1:  # a bare IPv6 address (a bind address, never a valid Host header)
        h = f"[{h}]"
    return h.rstrip(".")


class RequestGuard:
    """ASGI middleware: the Host / Origin / Content-Type checks above, answering OpenAI's error shape.

    Args:
        app: the wrapped ASGI app.
        bound_host: the address the server listens on (its names are always allowed).
        allowed_hosts: further host names (no port), or "*".
        allowed_origins: origins ("http://localhost:3000") whose requests are served, or "*".
    """

    def __init__(self, app: Any, bound_host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = ()) -> None:
        self.app = app
        hosts = [host_name(h) for h in allowed_hosts]
        self.any_host = "*" in hosts
        self.hosts = {*_LOOPBACK_NAMES, host_name(bound_host), *hosts}
        origins = [o.strip().lower().rstrip("/") for o in allowed_origins]
        self.any_origin = "*" in origins
        self.origins = set(origins)

    def check(self, method: str, headers: dict[bytes, bytes]) -> None:
        """Raise APIError (400 / 403 / 415) when a request fails a check."""
        host = headers.get(b"host")
        if host is None:
            raise APIError(400, "the request has no Host header", code="missing_host")
        name = host_name(host.decode("latin-1"))
        if not self.any_host and name not in self.hosts:
            raise APIError(403, f"the Host header {quote(name)} is not this server's address; start it with "
                                "--allowed-hosts to serve that name", code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and not self.any_origin:
            o = origin.decode("latin-1").strip().lower().rstrip("/")
            own = o.split("://", 1)[-1] == host.decode("latin-1").strip().lower()  # same origin: the Host's page
            if o not in self.origins and not own:
                raise APIError(403, f"requests from the web origin {quote(o)} are refused; start the server with "
                                    "--allowed-origins to allow it", code="origin_not_allowed")
        if method == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
            if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
                raise APIError(415, f"send the body as Content-Type: application/json (got {quote(kind or None)})",
                               code="unsupported_media_type")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers: dict[bytes, bytes] = {}
            for key, value in scope["headers"]:
                headers.setdefault(bytes(key).lower(), bytes(value))
            try:
                self.check(scope["method"], headers)
            except APIError as err:
                await _answer(send, err)
                return
        elif scope["type"] == "websocket":
            headers = {bytes(k).lower(): bytes(v) for k, v in reversed(scope["headers"])}
            try:
                self.check("GET", headers)
            except APIError as err:
                await _refuse_socket(scope, receive, send, err)
                return
        await self.app(scope, receive, send)


async def _answer(send: Any, err: APIError) -> None:
    body = err.to_bytes()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _refuse_socket(scope: dict[str, Any], receive: Any, send: Any, err: APIError) -> None:
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        body = err.to_bytes()
        await send({"type": "websocket.http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})
