"""The usage ledger (tandem/server/ledger.py) on its own: batched writes, the usage queries and their CSV, time
bounds, and writes that fail (a locked file, a full disk) without blocking or losing the rows queued."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tandem.server import ledger as ledger_mod
from tandem.server.ledger import Ledger, LedgerError, parse_time, to_csv


def _row(i: int, client: str | None = "alice", when: float | None = None) -> dict[str, Any]:
    end = when if when is not None else time.time()
    return {"started": end - 1, "time": end, "route": "chat", "model": "toy", "client": client, "status": 200,
            "prompt_tokens": 10 + i, "cached_tokens": i, "generated_tokens": 5, "ttft_ms": 20.0, "rounds": 4,
            "tokens_per_round": 1.25, "finish_reason": "length", "prompt": "secret"}


def test_rows_are_written_in_batches_and_read_back(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "sub" / "usage.sqlite", flush_s=0.05)
    try:
        for i in range(50):
            led.add(_row(i, "alice" if i % 2 else "bob"))
        assert led.flush(5.0)
        names, rows = led.usage()
        assert len(rows) == 50 and "prompt" not in names  # texts stay in the file
        names, rows = led.usage(group=["client"])
        got = {r[0]: dict(zip(names, r)) for r in rows}
        assert got["alice"]["requests"] == 25 and got["bob"]["requests"] == 25
        assert got["alice"]["prompt_tokens"] + got["bob"]["prompt_tokens"] == sum(10 + i for i in range(50))
        assert got["alice"]["tokens_per_round"] == pytest.approx(1.25)
    finally:
        led.close()
    assert led.written == 50 and led.errors == 0
    conn = sqlite3.connect(tmp_path / "sub" / "usage.sqlite")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT prompt FROM requests LIMIT 1").fetchone()[0] == "secret"
    assert (tmp_path / "sub" / "usage.sqlite").stat().st_mode & 0o077 == 0


def test_bounds_groups_and_csv(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "u.sqlite", flush_s=0.02)
    day = 86400.0
    try:
        for i, when in enumerate((1_000 * day + 10, 1_000 * day + 20, 1_001 * day + 5)):
            led.add(_row(i, when=when))
        led.flush()
        assert len(led.usage(since=1_000 * day, until=1_001 * day)[1]) == 2
        names, rows = led.usage(group=["day", "client"])
        assert [r[:3] for r in rows] == [("1972-09-27", "alice", 2), ("1972-09-28", "alice", 1)]
        text = to_csv(names, rows)
        assert text.splitlines()[0].startswith("day,client,requests,errors,prompt_tokens")
        with pytest.raises(ValueError, match="unknown group"):
            led.usage(group=["day; DROP TABLE requests"])
    finally:
        led.close()


def test_parse_time() -> None:
    assert parse_time("86400", "since") == 86400.0
    assert parse_time("1970-01-02", "since") == 86400.0
    assert parse_time("1970-01-02T01:00:00+01:00", "since") == 86400.0
    assert parse_time("", "since") is None
    assert abs(parse_time("7d", "since") - (time.time() - 7 * 86400)) < 5  # type: ignore[operator]
    with pytest.raises(ValueError, match="'until'"):
        parse_time("yesterday", "until")


def test_a_locked_file_delays_rows_without_blocking_or_losing_them(tmp_path: Path) -> None:
    path = tmp_path / "u.sqlite"
    led = Ledger(path, flush_s=0.02)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another program holds the file
    try:
        t0 = time.perf_counter()
        for i in range(5):
            led.add(_row(i))
        assert time.perf_counter() - t0 < 0.05  # add never waits for the file
        deadline = time.monotonic() + 10
        while led.errors == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert led.errors >= 1 and led.written == 0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert led.flush(20.0)
    assert led.written == 5 and led.dropped == 0
    led.close()


def test_a_full_disk_is_counted_and_rows_past_the_bound_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    full = threading.Event()
    full.set()
    real = ledger_mod._connect

    class FullDisk:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def __getattr__(self, name: str) -> Any:
            return getattr(self.conn, name)

        def __enter__(self) -> Any:
            return self.conn.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return self.conn.__exit__(*exc)

        def executemany(self, *args: Any) -> Any:
            if full.is_set():
                raise sqlite3.OperationalError("database or disk is full")
            return self.conn.executemany(*args)

    monkeypatch.setattr(ledger_mod, "_connect", lambda path: FullDisk(real(path)))
    led = Ledger(tmp_path / "u.sqlite", flush_s=0.01, max_pending=3)
    for i in range(5):
        led.add(_row(i))
    deadline = time.monotonic() + 5
    while led.errors == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert led.errors >= 1 and led.dropped == 2
    full.clear()
    assert led.flush(20.0)
    assert led.written == 3
    led.close()


def test_a_path_that_cannot_be_a_ledger_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "not-sqlite"
    bad.write_bytes(b"x" * 4096)
    with pytest.raises(LedgerError, match="cannot open it as a ledger"):
        Ledger(bad)
