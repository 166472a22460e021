"""`tandem serve --parallel N` with the official `openai` client: several streams run at once (each one's first
token arrives before the first stream ends), each stream's text equals the same request's alone, a client that
goes frees its slot, /health and /metrics count the slots, and the request log names the slot."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from server_fixtures import REPO_ROOT, ServerProcess

EMBEDDED = REPO_ROOT / "tandem" / "assets" / "default"
PROMPTS = ["def add(a, b):", "The capital of France is", "import numpy as np\n", "Once upon a time"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(EMBEDDED, "--parallel", "3", "--max-context", "2048", "--served-model-name", "toy")
    try:
        yield proc
    finally:
        proc.stop()


def _stream(client: OpenAI, prompt: str, seed: int | None, go: threading.Barrier | None = None
            ) -> tuple[str, float, float]:
    """The streamed text, the time of its first token and of its end."""
    if go is not None:
        go.wait()
    first = None
    parts = []
    stream = client.completions.create(model="toy", prompt=prompt, max_tokens=48, stream=True, seed=seed,
                                       temperature=0.0 if seed is None else 0.8,
                                       extra_body={"ignore_eos": True})
    for event in stream:
        if event.choices and event.choices[0].text:
            first = first if first is not None else time.perf_counter()
            parts.append(event.choices[0].text)
    return "".join(parts), first or 0.0, time.perf_counter()


def test_streams_run_at_once_with_their_own_bits(server: ServerProcess) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    seeds = [None, 11, None]
    alone = [_stream(client, PROMPTS[i], seeds[i])[0] for i in range(3)]
    go = threading.Barrier(3)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda i: _stream(client, PROMPTS[i], seeds[i], go), range(3)))
    assert [text for text, _, _ in runs] == alone  # batch invariance through the server
    first_end = min(end for _, _, end in runs)
    assert all(first < first_end for _, first, _ in runs), "a stream waited for another to end"
    assert server.logged("slot=0") and server.logged("slot=1")


def _health(server: ServerProcess) -> dict[str, Any]:
    body: dict[str, Any] = server.request("GET", "/health").json()
    return body


def test_health_and_metrics_count_slots(server: ServerProcess) -> None:
    health = _health(server)
    assert health["slots"] == 3 and health["running"] == 0
    text = server.request("GET", "/metrics").text
    assert "tandem_slots 3.0" in text


def test_a_client_that_goes_frees_its_slot(server: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    for _ in range(3):  # every slot taken by a client that then vanishes
        with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert r.status_code == 200
            next(line for line in lines if line.startswith("data: {"))
    deadline = time.monotonic() + 20
    while _health(server)["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(server)["running"] == 0
    r2 = server.request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 3
