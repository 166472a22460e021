"""Images for the image tests (tests/test_vision.py, tests/test_vision_api.py): small PNGs, data URIs, and the
bad-image corpus, every entry of which must be refused with a one-line ImageError (the server's 400), never a crash.

Import after ``pytest.importorskip("PIL.Image")``.
"""

from __future__ import annotations

import base64
import functools
import gzip
import io
import struct
import zlib

import numpy as np
from PIL import Image


def png(w: int, h: int, seed: int = 0, mode: str = "RGB") -> bytes:
    """A w x h PNG of random pixels (mode RGB, RGBA or L)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr[..., 0] if channels == 1 else arr, mode).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    """``data:<media_type>;base64,<data>``."""
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _raw_png(width: int, height: int, idat: bytes) -> bytes:
    """A grayscale 8-bit PNG of the given header size and IDAT payload, written by hand (any size, even 0)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


@functools.cache
def bomb(side: int = 7000) -> bytes:
    """A decompression bomb: a valid side x side grayscale PNG (49 MP, over the 40 MP limit) of ~50 KB."""
    z = zlib.compressobj(9)
    rows = bytes(side + 1) * 100  # filter byte 0, then the row's zero pixels
    return _raw_png(side, side, b"".join(z.compress(rows) for _ in range(side // 100)) + z.flush())


def _animated(fmt: str) -> bytes:
    buf = io.BytesIO()
    frames = [Image.new("RGB", (32, 32), (i * 40, 0, 0)) for i in range(3)]
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:])
    return buf.getvalue()


def _wide() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (17000, 4)).save(buf, "PNG")  # one side past the 16384 limit
    return buf.getvalue()


@functools.cache
def bad_images() -> list[tuple[str, bytes, str]]:
    """The bad-image corpus: (id, encoded bytes, a regex the error message matches)."""
    return [
        ("truncated", png(64, 64)[:200], "broken|could not be read"),
        ("garbage", b"not an image at all", "could not be read"),
        ("empty", b"", "could not be read"),
        ("zero-size", _raw_png(0, 10, zlib.compress(b"")), "could not be read|at least one pixel"),
        ("animated-gif", _animated("GIF"), "animated"),
        ("animated-webp", _animated("WEBP"), "animated"),
        ("bomb", bomb(), "limits"),
        ("huge-side", _wide(), "limits"),
        ("thin", png(1, 300), "aspect ratio"),
    ]


class ImageHost:
    """A local image host (http.server on 127.0.0.1, a port of its own) for the URL-fetch tests.

    Paths: any key of ``files`` (200, its bytes, Content-Length); ``/redirect/N`` (N redirects, then /img.png);
    ``/to-file`` (a redirect to a file:// URL); ``/slow/<path>`` (``slow_s`` seconds, then <path>);
    ``/endless`` (200, no length, zero bytes until the client hangs up); ``/declared-huge`` (a 10 GB
    Content-Length); ``/gzip`` (/img.png with Content-Encoding gzip); anything else 404. ``hits`` counts requests.
    """

    def __init__(self, files: dict[str, bytes], slow_s: float = 3.0) -> None:
        import http.server
        import threading
        import time

        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", **headers: str) -> None:
                self.send_response(code)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k.replace("_", "-"), v)
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # the client hung up (a fetch that timed out)
                    pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                host.hits += 1
                path = self.path
                if path.startswith("/slow/"):
                    time.sleep(host.slow_s)
                    path = path[len("/slow"):]
                if path.startswith("/redirect/"):
                    n = int(path.rsplit("/", 1)[1])
                    self._send(302, Location=f"/redirect/{n - 1}" if n > 1 else "/img.png")
                elif path == "/to-file":
                    self._send(302, Location="file:///etc/hostname")
                elif path == "/endless":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    try:
                        for _ in range(1024):  # 64 MiB at most, should the client never hang up
                            self.wfile.write(bytes(64 * 1024))
                    except OSError:
                        pass
                elif path == "/declared-huge":
                    self.send_response(200)
                    self.send_header("Content-Length", str(10 ** 10))
                    self.end_headers()
                    self.wfile.write(b"\x89PNG")
                elif path == "/gzip":
                    self._send(200, gzip.compress(files["/img.png"]), Content_Encoding="gzip")
                elif path in files:
                    self._send(200, files[path], Content_Type="image/png")
                else:
                    self._send(404, b"not here")

        self.files, self.slow_s, self.hits = files, slow_s, 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        """The http:// URL of ``path`` on this host."""
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()
