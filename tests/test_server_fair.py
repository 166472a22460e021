"""Fair request preparation against a real server on loopback: a prompt whose bytes cannot fit the context is
refused before it is tokenized, and a tiny request is not held back by huge ones being prepared (a latency ratio,
medians on both sides, not a timed speed test)."""

from __future__ import annotations

import concurrent.futures
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from server_fixtures import ONE_THREAD, ServerProcess

pytestmark = pytest.mark.slow  # megabytes of bodies, timed repeatedly; nothing compiled on its path but the engine's
NO_THINK = {"enable_thinking": False}
TINY = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "ignore_eos": True,
                     "chat_template_kwargs": NO_THINK})
HUGE_CHAT = orjson.dumps({"messages": [{"role": "user", "content": "word " * 1_340_000}], "max_tokens": 4,
                          "chat_template_kwargs": NO_THINK})  # 6.7 MB, as the issue's
HUGE_CHOICE = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "guided_choice": [f"choice number {i}" for i in range(100_000)]})
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(served_model: Path) -> Iterator[ServerProcess]:
    model: Path = served_model
    proc = ServerProcess(model, "--max-context", "4096", env=ONE_THREAD)
    try:
        yield proc
    finally:
        proc.stop()


def _post(server: ServerProcess, body: bytes) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=JSON, timeout=120)
    return r.status_code, time.perf_counter() - t0


def _post_raw(server: ServerProcess, body: bytes) -> int:
    """POST a prebuilt body on a raw socket (sendall releases the GIL, so this test process's own sending does
    not slow its tiny request); returns the status."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = b""
        while b"\r\n" not in head:
            part = sock.recv(4096)
            if not part:
                break
            head += part
    return int(head.split(b" ", 2)[1])


def test_prompt_over_the_context_in_bytes_is_refused_before_tokenizing(server: ServerProcess) -> None:
    r = server.request("POST", "/v1/chat/completions", content=HUGE_CHAT, headers=JSON)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "bytes" in err["message"]  # the byte bound answered, not a count of tokens
    r = server.request("POST", "/v1/completions", json={"prompt": "word " * 1_000_000, "max_tokens": 2})
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"]


@pytest.mark.parametrize("huge", [HUGE_CHAT, HUGE_CHOICE], ids=["6.7MB-chats", "100k-guided-choices"])
def test_tiny_request_is_not_held_back_by_huge_ones(server: ServerProcess, huge: bytes) -> None:
    _post(server, TINY)  # warm
    alone, loaded = [], []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for _ in range(5):  # alone and loaded alternate, so a drift in the machine's load hits both alike
            alone.append(_post(server, TINY)[1])
            bigs = [pool.submit(_post_raw, server, huge) for _ in range(2)]
            time.sleep(0.05)  # both huge bodies on their way first
            status, seconds = _post(server, TINY)
            assert status == 200
            loaded.append(seconds)
            assert [f.result() for f in bigs] == [400, 400]
    ratio = statistics.median(loaded) / statistics.median(alone)
    print(f"tiny alone {statistics.median(alone):.3f} s, beside two huge bodies {statistics.median(loaded):.3f} s,"
          f" ratio {ratio:.2f}")
    assert ratio <= 2.0, (loaded, alone)
