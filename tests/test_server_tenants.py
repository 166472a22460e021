"""Tenants by key against a real server on loopback: several keys (flags, a name:key file), UTF-8 keys, a prefix
cache namespace per tenant (no cross-tenant probing through cached_tokens), the tenant's name in the log and never
its key, /metrics behind the keys with --metrics-auth."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_fixtures import ServerProcess
from tandem.server.tenants import parse_keys

ALICE, BOB, CAROL = "sk-alice", "ключ-bob-🔑", "sk-carol"
PROMPT = [(7 * i + 3) % 300 + 5 for i in range(200)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, served_model: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("tenants")
    model: Path = served_model
    keys = root / "keys"
    keys.write_text(f"# tenants\nalice:{ALICE}\n\nbob:{BOB}\n", encoding="utf-8")
    proc = ServerProcess(model, "--max-context", "1024", "--prefix-chunk", "64", "--api-key-file", str(keys),
                         "--metrics-auth")
    try:
        yield proc
    finally:
        proc.stop()


def _complete(server: ServerProcess, key: str, **extra: Any) -> int:
    r = server.request("POST", "/v1/completions", headers={"x-api-key": key.encode("utf-8")},
                       json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0)


def test_keys_compare_as_utf8_and_name_the_tenant(server: ServerProcess) -> None:
    r = server.request("GET", "/v1/models", headers={"Authorization": b"Bearer " + BOB.encode("utf-8")})
    assert r.status_code == 200
    r = server.request("GET", "/v1/models", headers={"x-api-key": BOB.encode("latin-1", "replace")})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert server.request("GET", "/v1/models", headers={"x-api-key": CAROL}).status_code == 401
    assert server.request("GET", "/v1/models").status_code == 401


def test_tenants_cannot_probe_each_others_prompts(server: ServerProcess) -> None:
    assert _complete(server, ALICE) == 0
    assert _complete(server, BOB) == 0  # alice's prompt is cached, but not in bob's namespace
    assert _complete(server, ALICE) > 0
    assert _complete(server, BOB) > 0  # bob's own first request is now cached for him
    shared = {"cache_salt": "team"}
    assert _complete(server, ALICE, prompt=PROMPT[::-1], **shared) == 0
    assert _complete(server, BOB, prompt=PROMPT[::-1], **shared) > 0  # a salt both send is one namespace
    r = server.request("POST", "/v1/completions", headers={"x-api-key": ALICE},
                       json={"prompt": "x", "max_tokens": 1, "cache_salt": "\x00tenant:bob"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_log_names_the_tenant_never_the_key(server: ServerProcess) -> None:
    _complete(server, ALICE)
    log = "".join(server.errors)
    assert "tenant=alice" in log and "tenant=bob" in log
    assert ALICE not in log and BOB not in log


def test_metrics_behind_the_keys(server: ServerProcess) -> None:
    assert server.request("GET", "/metrics").status_code == 401
    assert server.request("GET", "/metrics", headers={"x-api-key": ALICE}).status_code == 200
    assert server.request("GET", "/health").status_code == 200  # always open


def test_parse_keys() -> None:
    assert parse_keys(["a"], None, "env") == {"default": "a"}
    assert parse_keys(["a", "b"], None, None) == {"key1": "a", "key2": "b"}
    assert parse_keys([], None, "env") == {"default": "env"}
    assert parse_keys([], None, None) == {}
    with pytest.raises(ValueError, match="key file"):
        parse_keys([], "/nonexistent/keys", None)
