"""The server's image URL fetches (``--allow-image-urls``): between parsing a request and building its prompt, every
http(s) image URL in its messages is fetched in the server's fetch threads while the event loop waits for them, so
a slow or stalled image host holds neither the loop nor the preparation threads, and no other request waits for it.

The parsers (protocol.image_parts, anthropic_request, responses_request) refuse image URLs already when the flag is
off, naming the part; a fetch's own bounds (time, bytes, redirects, schemes) are tandem/image_fetch.py's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from tandem.image_fetch import URLS_OFF, ImageFetcher, is_image_url
from tandem.images import ImageError
from tandem.multimodal import is_image_part
from tandem.server.errors import invalid
from tandem.server.protocol import GenerationRequest

if TYPE_CHECKING:
    from tandem.server.state import ServerState


def _url_of(part: Any) -> str | None:
    """The http(s) URL an image part names, else None (inline data)."""
    value = part.get("image_url") if isinstance(part, dict) else None
    value = value.get("url") if isinstance(value, dict) else value
    return value if is_image_url(value) else None


def image_urls(req: GenerationRequest) -> list[tuple[int, str]]:
    """(index among the request's images, URL) of every image part in ``req.messages`` that names an http(s) URL,
    the index counted as tandem/multimodal.py ``collect_images`` counts (message order, then part order)."""
    out: list[tuple[int, str]] = []
    index = 0
    for m in req.messages or []:
        content = m.get("content")
        for part in content if isinstance(content, list) else []:
            if is_image_part(part):
                url = _url_of(part)
                if url is not None:
                    out.append((index, url))
                index += 1
    return out


def _count_images(req: GenerationRequest) -> int:
    return sum(1 for m in req.messages or [] if isinstance(m.get("content"), list)
               for p in m["content"] if is_image_part(p))


async def fetch_image_urls(state: ServerState, req: GenerationRequest) -> None:
    """Fetch every http(s) image URL of ``req`` (concurrently, in ``state.fetch_threads()``) and put the bytes in
    place of the URL (``{"type": "image", "image": <bytes>}``), so preparing the prompt reaches no network.
    Nothing to do (and no thread used) when the request names no URL.

    Raises: APIError 400 naming "messages": URLs while the engine has no fetcher (the parsers refuse them first),
    more images than the limit (checked before anything is fetched), a failed fetch ("image K: fetching URL: why").
    """
    found = image_urls(req)
    if not found:
        return
    fetcher: ImageFetcher | None = state.engine.image_fetcher
    if fetcher is None:
        raise invalid("messages", URLS_OFF)
    limits = state.engine.image_limits
    total = _count_images(req)
    if total > limits.max_images:
        raise invalid("messages", f"the request has {total} images; the limit is {limits.max_images}")
    loop = asyncio.get_running_loop()
    pool = state.fetch_threads(fetcher.max_concurrent)

    async def one(index: int, url: str) -> tuple[str, bytes]:
        try:
            return url, await loop.run_in_executor(pool, fetcher.fetch, url, limits.max_bytes)
        except ImageError as exc:
            raise invalid("messages", f"image {index}: {exc}") from None

    first: dict[str, int] = {}
    for index, url in found:
        first.setdefault(url, index)  # a URL named twice is fetched once
    fetched = dict(await asyncio.gather(*(one(i, u) for u, i in first.items())))
    req.messages = [_with_bytes(m, fetched) for m in req.messages or []]


def _with_bytes(message: dict[str, Any], fetched: dict[str, bytes]) -> dict[str, Any]:
    """``message`` with each image part naming a fetched URL replaced by an image part holding its bytes."""
    content = message.get("content")
    if not isinstance(content, list) or not any(_url_of(p) in fetched for p in content):
        return message
    parts = [{"type": "image", "image": fetched[url]} if (url := _url_of(p)) in fetched else p for p in content]
    return {**message, "content": parts}
