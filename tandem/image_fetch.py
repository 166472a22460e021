"""Image URLs: fetch an ``http(s)`` image a request names, bounded in time, bytes and redirects (``--allow-image-urls``).

Off by default. When on, the server fetches whatever URL a client names, from the server's own network: a client
can make it reach addresses the client cannot (loopback, the LAN, a cloud metadata service). docs/security.md says
when to turn it on. What bounds a fetch:
- the scheme: ``http`` and ``https`` only, redirects included (httpx refuses any other scheme);
- redirects: at most ``max_redirects`` (3);
- time: each connect / read waits at most ``timeout_s`` (10 s) and the body is cut once ``timeout_s`` has passed
  since the fetch began, so one fetch takes at most about twice ``timeout_s``;
- bytes: the request's image byte limit (``ImageLimits.max_bytes``); a larger ``Content-Length`` is refused before
  the body is read, and the body is read in chunks and cut off at the limit, so a huge or endless body never sits
  in memory; a body with a content encoding (gzip ...) is refused, so no decompression can grow it;
- no proxy variables or ``.netrc`` credentials from the server's environment (httpx ``trust_env=False``), and no
  cookies kept from one fetch to the next (a client of its own each time).

The client is httpx (the ``vision`` extra installs it), imported when the first URL is fetched. Every failure is an
``ImageError`` (a ValueError: the server's 400) with one line saying why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tandem.images import ImageError

URLS_OFF = ("image URLs are not fetched unless the server runs with --allow-image-urls; send the image inline as "
            "base64 data (a data:image/png;base64,... URI)")
CHUNK_BYTES = 64 * 1024


def is_image_url(value: Any) -> bool:
    """Whether ``value`` is an ``http://`` or ``https://`` URL (any letter case): a URL to fetch, not inline data."""
    return isinstance(value, str) and value[:8].lower().startswith(("http://", "https://"))


def _shown(url: str) -> str:
    return url if len(url) <= 100 else url[:97] + "..."


@dataclass(frozen=True)
class ImageFetcher:
    """Fetches ``http(s)`` image URLs (module docstring: the bounds).

    Attributes:
        timeout_s: the longest one connect or read waits, and the time after which the body is cut (seconds).
        max_redirects: redirects followed at most (then an error).
        max_concurrent: fetches the server runs at once (its fetch threads); more wait for a thread.
    """

    timeout_s: float = 10.0
    max_redirects: int = 3
    max_concurrent: int = 8

    def fetch(self, url: str, max_bytes: int) -> bytes:
        """The body of ``GET url``: the encoded image.

        Args: url: an http(s) URL. max_bytes: the most bytes the body may have (the image byte limit).
        Returns: the body's bytes (at most ``max_bytes``).
        Raises: ImageError (another scheme, a bad URL, no answer, a timeout, too many redirects, a status other
            than 200, a content encoding, more than ``max_bytes``, httpx not installed).
        """
        if not is_image_url(url):
            raise ImageError(f"{_shown(url)!r} is not an http(s) URL")
        httpx = _httpx()
        deadline = time.monotonic() + self.timeout_s
        try:
            with httpx.Client(follow_redirects=True, max_redirects=self.max_redirects, trust_env=False,
                              timeout=httpx.Timeout(self.timeout_s)) as client:
                with client.stream("GET", url, headers={"Accept": "image/*", "Accept-Encoding": "identity"}) as r:
                    if r.status_code != 200:
                        raise ImageError(f"fetching {_shown(url)}: the server answered {r.status_code}")
                    encoding = r.headers.get("content-encoding", "identity").strip().lower()
                    if encoding not in ("", "identity"):
                        raise ImageError(f"fetching {_shown(url)}: the body is {encoding}-encoded; send the image "
                                         "itself")
                    declared = r.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > max_bytes:
                        raise ImageError(f"fetching {_shown(url)}: the image has {declared} bytes; the limit is "
                                         f"{max_bytes}")
                    return _read_capped(r, url, max_bytes, deadline, self.timeout_s)
        except httpx.TooManyRedirects:
            raise ImageError(f"fetching {_shown(url)}: more than {self.max_redirects} redirects") from None
        except httpx.TimeoutException:
            raise ImageError(f"fetching {_shown(url)}: no answer within {self.timeout_s:g} s") from None
        except httpx.UnsupportedProtocol:
            raise ImageError(f"fetching {_shown(url)}: redirected to a URL that is not http(s)") from None
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise ImageError(f"fetching {_shown(url)} failed ({type(e).__name__})") from None


def _read_capped(response: Any, url: str, max_bytes: int, deadline: float, timeout_s: float) -> bytes:
    """The raw body in chunks, cut off past ``max_bytes`` or the deadline. Raises: ImageError."""
    parts: list[bytes] = []
    size = 0
    for chunk in response.iter_raw(CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise ImageError(f"fetching {_shown(url)}: the image is over the {max_bytes}-byte limit")
        if time.monotonic() > deadline:
            raise ImageError(f"fetching {_shown(url)}: the body did not arrive within {timeout_s:g} s")
        parts.append(chunk)
    return b"".join(parts)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ImageError("this server cannot fetch image URLs: httpx is not installed (pip install httpx)") from None
    return httpx
