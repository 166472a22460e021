"""Live activity, the usage ledger and the dashboard's files through a real `tandem serve` on loopback: the page and
its assets with their types, /v1/activity and its event stream while requests run, the ledger's rows equal to the
requests sent (a concurrent burst, then again after a SIGKILL and a restart), keys, and the page's own logic under
node's test runner."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import REPO_ROOT, ServerProcess

EMBEDDED = REPO_ROOT / "tandem" / "assets" / "default"
KEY = "k-dash"


@pytest.fixture(scope="module")
def ledger_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ledger") / "usage.sqlite"


@pytest.fixture(scope="module")
def server(ledger_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(EMBEDDED, "--parallel", "2", "--max-context", "1024", "--served-model-name", "toy",
                         "--ledger", str(ledger_path), "--api-key-file", str(_keys(ledger_path.parent)))
    try:
        yield proc
    finally:
        proc.stop()


def _keys(folder: Path) -> Path:
    path = folder / "keys.txt"
    path.write_text(f"alice:{KEY}\nbob:{KEY}-bob\n")
    return path


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(server: ServerProcess, prompt: str, max_tokens: int, key: str = KEY, stream: bool = False
              ) -> dict[str, Any]:
    body = {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if not stream:
        r = server.request("POST", "/v1/completions", json=body, headers=_auth(key))
        assert r.status_code == 200, r.text
        usage: dict[str, Any] = r.json()["usage"]
        return usage
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    usage = {}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth(key), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
    return usage


def test_page_and_assets_are_served_with_their_types(server: ServerProcess) -> None:
    page = server.request("GET", "/dashboard")  # open: it holds no data
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert 'src="/dashboard/dashboard.js"' in page.text and "http" not in page.text.split("<body>")[1]
    for name, kind in (("dashboard.js", "text/javascript"), ("logic.js", "text/javascript"),
                       ("dashboard.css", "text/css")):
        r = server.request("GET", f"/dashboard/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert r.headers["x-content-type-options"] == "nosniff"
    assert server.request("GET", "/dashboard/package.json").status_code == 404
    assert server.request("GET", "/dashboard/..%2Fapp.py").status_code == 404


def test_the_data_routes_need_a_key(server: ServerProcess) -> None:
    for path in ("/v1/activity", "/v1/activity/stream", "/v1/usage"):
        assert server.request("GET", path).status_code == 401, path
    assert server.request("GET", "/v1/usage?since=never", headers=_auth()).status_code == 400
    assert server.request("GET", "/v1/usage?group=nope", headers=_auth()).status_code == 400
    assert server.request("GET", "/v1/activity/stream?interval=0", headers=_auth()).status_code == 400


def test_activity_shows_a_running_request(server: ServerProcess) -> None:
    done: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: done.append(_complete(server, "Once upon a time", 160, stream=True)))
    worker.start()
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        body = server.request("GET", "/v1/activity", headers=_auth()).json()
        seen = next((r for r in body["requests"] if r["phase"] == "decode" and r["generated_tokens"] > 4), {})
        time.sleep(0.05)
    worker.join(60)
    assert seen, "no running request was shown"
    assert seen["client"] == "alice" and seen["slot"] in (0, 1) and seen["route"] == "completions"
    assert seen["ttft_s"] > 0 and seen["tokens_per_s"] > 0 and seen["tokens_per_round"] >= 1
    body = server.request("GET", "/v1/activity", headers=_auth()).json()
    assert body["requests"] == [] and body["slots"] == 2 and body["model"] == "toy"
    assert body["totals"]["generated_tokens"] >= 160 and body["cache"]["enabled"]
    assert body["memory"]["device"] is None and body["memory"]["host_rss_bytes"] > 0
    assert any(tokens > 0 for _, tokens, _ in body["history"])
    finished = body["recent"][-1]
    assert finished["generated_tokens"] == 160 and finished["finish_reason"] == "length"


def test_activity_stream_sends_events(server: ServerProcess) -> None:
    events = []
    with httpx.stream("GET", server.url + "/v1/activity/stream?interval=0.2", headers=_auth(), timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
    assert all(e["object"] == "activity" for e in events)
    seconds = [h[0] for e in events for h in e["history"]]
    assert len(seconds) == len(set(seconds))  # each second is sent once


def test_a_resent_prompt_names_its_cache_tier(server: ServerProcess) -> None:
    prompt = "The tiers of a cache are resident, host and disk; " * 8
    _complete(server, prompt, 4)
    assert _complete(server, prompt, 4)["prompt_tokens_details"]["cached_tokens"] > 0
    last = _usage(server, "?since=1h")[-1]
    assert last["cache_tier"] == "resident" and last["cached_tokens"] > 0 and last["client"] == "alice"


def _usage(server: ServerProcess, query: str = "") -> list[dict[str, Any]]:
    r = server.request("GET", "/v1/usage" + query, headers=_auth())
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def test_ledger_rows_equal_the_requests_sent_across_a_sigkill(server: ServerProcess, ledger_path: Path) -> None:
    before = _usage(server, "?group=client")
    jobs = [("alice" if i % 3 else "bob", f"request {i} says", 8 + i, i % 2 == 0) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(lambda j: (j[0], _complete(server, j[1], j[2], KEY if j[0] == "alice" else KEY + "-bob",
                                                          stream=j[3])), jobs))
    sent = {c: {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0} for c in ("alice", "bob")}
    for client, usage in usages:
        sent[client]["requests"] += 1
        sent[client]["prompt_tokens"] += usage["prompt_tokens"]
        sent[client]["generated_tokens"] += usage["completion_tokens"]
    for row in before:  # rows of the earlier tests
        for k in ("requests", "prompt_tokens", "generated_tokens"):
            sent[row["client"]][k] += row[k]

    def totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
        return {r["client"]: {k: r[k] for k in ("requests", "prompt_tokens", "generated_tokens")} for r in rows}

    assert totals(_usage(server, "?group=client")) == sent
    raw = _usage(server, "?since=1h")
    assert all(r["status"] == 200 and r["model"] == "toy" and r["agent"] for r in raw)
    csv_text = server.request("GET", "/v1/usage?group=day,client&format=csv", headers=_auth()).text
    assert csv_text.startswith("day,client,requests")
    server.proc.kill()  # SIGKILL: no drain, no close
    server.proc.wait(10)
    again = ServerProcess(EMBEDDED, "--parallel", "2", "--max-context", "1024", "--served-model-name", "toy",
                          "--ledger", str(ledger_path), "--api-key", KEY)
    try:
        r = again.request("GET", "/v1/usage?group=client", headers=_auth())
        assert totals(r.json()["data"]) == sent
    finally:
        again.stop()


def test_off_switches() -> None:
    proc = ServerProcess(EMBEDDED, "--parallel", "1", "--max-context", "512", "--ledger", "off", "--activity", "off")
    try:
        assert proc.request("GET", "/v1/usage").status_code == 404
        assert proc.request("GET", "/v1/activity").json() == {"object": "activity", "enabled": False}
    finally:
        proc.stop()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_page_logic_under_node() -> None:
    run = subprocess.run(["node", "--test", str(REPO_ROOT / "tests" / "js")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
