"""Shutdown against a real server on loopback: --drain-timeout bounds the drain; a second signal ends at once;
each open stream gets its API's error event before the close; the exit status says which happened."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import ONE_THREAD, ServerProcess

pytestmark = pytest.mark.slow  # three servers, long streams and drain timeouts; signal handling compiles nothing
LONG = {"max_tokens": 3000, "ignore_eos": True, "stream": True}
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **LONG}),
    # no ignore_eos in these APIs: greedy on the random model loops without writing an eos
    "messages": ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                                  "stream": True, "temperature": 0}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 3000, "stream": True, "temperature": 0}),
}


@pytest.fixture(scope="module")
def model_dir(served_model: Path) -> Path:
    return served_model


def _open_stream(proc: ServerProcess, route: str, lines: list[str], started: threading.Event) -> threading.Thread:
    path, body = STREAMS[route]

    def read() -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", proc.url + path, json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data:"):
                    started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert started.wait(30), lines
    return thread


def _error_event(route: str, lines: list[str]) -> bool:
    text = "\n".join(lines[-6:])
    if route == "messages":
        return "event: error" in text and "overloaded_error" in text and "shutting down" in text
    return '"shutdown"' in text and "shutting down" in text


@pytest.mark.parametrize("route", sorted(STREAMS))
def test_second_signal_ends_at_once_with_error_events(model_dir: Path, route: str) -> None:
    proc = ServerProcess(model_dir, "--max-context", "4096", "--drain-timeout", "120", env=ONE_THREAD)
    try:
        lines: list[str] = []
        reader = _open_stream(proc, route, lines, threading.Event())
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.request("GET", "/health", timeout=5).json()["status"] == "draining"
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 4
        ended_s = time.monotonic() - t0
        reader.join(10)
        assert _error_event(route, lines), lines[-6:]
        assert ended_s < 15, ended_s  # not the drain's 120 s, nor a 3000-token generation
    finally:
        proc.stop()


def test_drain_timeout_cuts_the_drain(model_dir: Path) -> None:
    proc = ServerProcess(model_dir, "--max-context", "4096", "--drain-timeout", "1", env=ONE_THREAD)
    try:
        lines: list[str] = []
        reader = _open_stream(proc, "chat", lines, threading.Event())
        proc.proc.send_signal(signal.SIGINT)
        assert proc.proc.wait(30) == 3
        reader.join(10)
        assert _error_event("chat", lines), lines[-6:]
    finally:
        proc.stop()


def test_drain_that_finishes_exits_0(model_dir: Path) -> None:
    proc = ServerProcess(model_dir, "--max-context", "1024", "--drain-timeout", "60", env=ONE_THREAD)
    try:
        r = proc.request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
