"""The usage ledger: one SQLite row per finished generating request (``--ledger PATH``, off with ``--ledger off``).

A row: when it arrived and ended, route, model, client (the tenant's name, never its key), the User-Agent's
product, status, prompt / cached / generated tokens, time to first token, duration, queue time, decode speed,
finish reason, speculation's rounds, tokens a round and acceptance, the slot, and the cache tier its prefix came
from. The prompt and the reply's text only with ``--log-prompts`` (they may hold private data).

Writes never run on the event loop and never fail a request: ``add`` appends to a bounded in-memory queue and one
writer thread inserts what has gathered every ``flush_s`` seconds in one transaction. The file is in WAL mode with
``synchronous=NORMAL``: a committed row survives the process's crash or SIGKILL (not an OS crash's last moments).
A write that fails (a full disk, a file locked by another program past ``busy_timeout``) is retried with a backoff,
logged as a warning (once a minute at most) and counted (``errors``); rows past ``max_pending`` waiting are dropped
and counted (``dropped``). Reads (``usage``) open their own connection in the caller's thread (the route runs them
off the event loop); WAL readers do not block the writer.
"""

from __future__ import annotations

import csv
import datetime
import io
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("tandem.server.ledger")

COLUMNS = ("started", "time", "route", "model", "client", "agent", "status", "prompt_tokens", "cached_tokens",
           "generated_tokens", "ttft_ms", "duration_ms", "queue_ms", "tokens_per_s", "finish_reason", "rounds",
           "tokens_per_round", "acceptance", "slot", "cache_tier", "prompt", "reply")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    started REAL NOT NULL,      -- arrival, Unix seconds
    time REAL NOT NULL,         -- end, Unix seconds
    route TEXT NOT NULL, model TEXT, client TEXT, agent TEXT, status INTEGER,
    prompt_tokens INTEGER, cached_tokens INTEGER, generated_tokens INTEGER,
    ttft_ms REAL, duration_ms REAL, queue_ms REAL, tokens_per_s REAL, finish_reason TEXT,
    rounds INTEGER, tokens_per_round REAL, acceptance REAL, slot INTEGER, cache_tier TEXT,
    prompt TEXT, reply TEXT);
CREATE INDEX IF NOT EXISTS requests_time ON requests(time);
"""
SCHEMA_VERSION = 1
# usage's group keys: each a fixed SQL expression (a request's words never reach the SQL text)
GROUPS = {"day": "strftime('%Y-%m-%d', time, 'unixepoch')", "hour": "strftime('%Y-%m-%dT%H:00', time, 'unixepoch')",
          "client": "client", "agent": "agent", "model": "model", "route": "route", "status": "status",
          "finish_reason": "finish_reason", "cache_tier": "cache_tier"}
_SUMS = ("count(*) AS requests, sum(status >= 400) AS errors, sum(prompt_tokens) AS prompt_tokens, "
         "sum(cached_tokens) AS cached_tokens, sum(generated_tokens) AS generated_tokens, avg(ttft_ms) AS ttft_ms, "
         "avg(duration_ms) AS duration_ms, avg(tokens_per_s) AS tokens_per_s, sum(rounds) AS rounds, "
         "sum(tokens_per_round * rounds) / nullif(sum(rounds), 0) AS tokens_per_round, "
         "min(time) AS first, max(time) AS last")
RAW_COLUMNS = tuple(c for c in COLUMNS if c not in ("prompt", "reply"))  # the texts stay in the file
WARN_EVERY_S = 60.0
BUSY_TIMEOUT_MS = 1000


class LedgerError(ValueError):
    """The ledger file cannot be opened at start (a folder that cannot be made, a file that is not SQLite)."""


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                           check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


class Ledger:
    """The ledger file and its writer thread.

    Args:
        path: the SQLite file (its folder is made; created mode 0600 where new).
        flush_s: the writer's batching period: a row is committed at most about this long after ``add``.
        max_pending: rows kept waiting while writes fail; older ones are dropped past it.
    Attributes: written, errors, dropped: rows committed, failed writes, rows dropped (since start).
    Raises: LedgerError when the file cannot be opened or made a ledger.
    """

    def __init__(self, path: str | Path, flush_s: float = 0.25, max_pending: int = 100_000) -> None:
        self.path = Path(path).expanduser()
        self.flush_s = flush_s
        self.max_pending = max_pending
        self.written = self.errors = self.dropped = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists()
            conn = _connect(self.path)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(_SCHEMA)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            finally:
                conn.close()
            if new:
                self.path.chmod(0o600)
        except (OSError, sqlite3.Error) as exc:
            raise LedgerError(f"--ledger {self.path}: cannot open it as a ledger: {exc}") from exc
        self._pending: list[tuple[Any, ...]] = []
        self._cond = threading.Condition()
        self._busy = False  # a batch is being written
        self._stop = False
        self._warned = 0.0
        self._thread = threading.Thread(target=self._run, name="tandem-ledger", daemon=True)
        self._thread.start()

    def add(self, row: dict[str, Any]) -> None:
        """Queue one request's row (COLUMNS' keys; missing ones are NULL). Thread-safe, never blocks on the file."""
        values = tuple(row.get(c) for c in COLUMNS)
        with self._cond:
            self._pending.append(values)
            if len(self._pending) > self.max_pending:
                cut = len(self._pending) - self.max_pending
                del self._pending[:cut]
                self.dropped += cut
            self._cond.notify()

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait until every row queued so far is committed (or ``timeout_s`` passed); True when it is."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.notify()
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self.flush_s))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (at most ``timeout_s``) and stop the writer."""
        self.flush(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        backoff = self.flush_s
        while True:
            with self._cond:
                if not self._pending and not self._stop:
                    self._cond.wait(self.flush_s)
                if self._stop and not self._pending:
                    break
                batch, self._pending = self._pending, []
                self._busy = bool(batch)
            if not batch:
                continue
            try:
                conn = conn or _connect(self.path)
                with conn:
                    conn.execute("BEGIN")
                    conn.executemany(f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES "
                                     f"({', '.join('?' * len(COLUMNS))})", batch)
                written, backoff = len(batch), self.flush_s
            except (OSError, sqlite3.Error) as exc:
                written = 0
                self._failed(exc, batch)
                if conn is not None:
                    conn.close()
                    conn = None
                time.sleep(backoff)
                backoff = min(10.0, backoff * 2)
            with self._cond:
                self.written += written
                self._busy = False
                self._cond.notify_all()
            if written:
                time.sleep(self.flush_s)  # let the next batch gather
        if conn is not None:
            conn.close()

    def _failed(self, exc: BaseException, batch: list[tuple[Any, ...]]) -> None:
        """Count a failed write, warn (once a WARN_EVERY_S at most) and put its rows back in front."""
        with self._cond:
            self.errors += 1
            self._pending[:0] = batch
            if len(self._pending) > self.max_pending:
                cut = len(self._pending) - self.max_pending
                del self._pending[:cut]
                self.dropped += cut
            waiting = len(self._pending)
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning("ledger: cannot write %s (%s); %d rows wait, retried (requests are not affected)",
                        self.path, exc, waiting)

    # ------------------------------------------------------------------------------------------- reads
    def usage(self, since: float | None = None, until: float | None = None, group: Sequence[str] = (),
              limit: int = 1000) -> tuple[list[str], list[tuple[Any, ...]]]:
        """The rows that ended in [since, until) (Unix seconds; None: unbounded): with ``group`` (GROUPS' keys),
        one aggregate row per group (requests, errors, token sums, mean TTFT / duration / speed, rounds, tokens a
        round, first and last end) ordered by the keys; without, the rows themselves (RAW_COLUMNS, the texts
        left out) in time order, at most ``limit``. Returns (column names, rows).
        Raises: ValueError for an unknown group key; sqlite3.Error when the file cannot be read."""
        where, args = [], []
        if since is not None:
            where.append("time >= ?")
            args.append(since)
        if until is not None:
            where.append("time < ?")
            args.append(until)
        cond = f" WHERE {' AND '.join(where)}" if where else ""
        bad = [g for g in group if g not in GROUPS]
        if bad:
            raise ValueError(f"unknown group {bad[0]!r}; one of {', '.join(GROUPS)}")
        if group:
            keys = ", ".join(f"{GROUPS[g]} AS {g}" for g in group)
            order = ", ".join(str(i + 1) for i in range(len(group)))
            sql = f"SELECT {keys}, {_SUMS} FROM requests{cond} GROUP BY {order} ORDER BY {order}"
        else:
            sql = f"SELECT {', '.join(RAW_COLUMNS)} FROM requests{cond} ORDER BY time, id LIMIT ?"
            args.append(limit)
        conn = _connect(self.path)
        try:
            conn.execute("PRAGMA query_only=1")
            cur = conn.execute(sql, args)
            names = [d[0] for d in cur.description]
            return names, cur.fetchall()
        finally:
            conn.close()


def row_of(record: Any, wall_end: float) -> dict[str, Any]:
    """A ledger row from a finished request's ``RequestRecord`` (tandem/server/reqlog.py) ending at ``wall_end``
    (Unix seconds)."""
    def ms(s: float | None) -> float | None:
        return None if s is None else round(s * 1e3, 3)

    return {"started": record.wall_arrived, "time": wall_end, "route": record.route, "model": record.model,
            "client": record.tenant, "agent": record.agent, "status": record.status,
            "prompt_tokens": record.prompt_tokens, "cached_tokens": record.cached_tokens or 0,
            "generated_tokens": record.completion_tokens, "ttft_ms": ms(record.ttft_s),
            "duration_ms": ms(wall_end - record.wall_arrived), "queue_ms": ms(record.queue_s),
            "tokens_per_s": record.tokens_per_s, "finish_reason": record.finish_reason, "rounds": record.num_rounds,
            "tokens_per_round": record.round_tokens / record.num_rounds if record.num_rounds else None,
            "acceptance": record.num_accepted / record.num_drafted if record.num_drafted else None,
            "slot": record.slot, "cache_tier": record.cache_tier or None, "prompt": record.prompt,
            "reply": record.reply}


def parse_time(text: str | None, param: str) -> float | None:
    """A bound of ``GET /v1/usage``: Unix seconds, an ISO 8601 date or date-time (UTC unless it names a zone),
    or a span back from now ("7d", "12h", "30m"). None for None or "". Raises: ValueError naming ``param``."""
    if text is None or text == "":
        return None
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[-1:] in units and text[:-1].isdigit():
        return time.time() - int(text[:-1]) * units[text[-1]]
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"'{param}' takes Unix seconds, an ISO 8601 date or date-time, or a span like 7d, 12h, "
                         "30m") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def to_csv(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The rows as CSV text with a header line."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(names)
    writer.writerows(rows)
    return out.getvalue()


def to_json(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """The rows as JSON objects."""
    return [dict(zip(names, r)) for r in rows]


class LedgerCollector:
    """Prometheus series of the ledger: rows written, failed writes, rows dropped (counters), rows waiting."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Any]:
        """The series, read at each scrape."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        led = self.ledger
        yield CounterMetricFamily("tandem_ledger_rows", "usage rows committed to the ledger", value=led.written)
        yield CounterMetricFamily("tandem_ledger_errors", "ledger writes that failed (retried)", value=led.errors)
        yield CounterMetricFamily("tandem_ledger_dropped_rows", "usage rows dropped while writes failed",
                                  value=led.dropped)
        yield GaugeMetricFamily("tandem_ledger_pending_rows", "usage rows waiting to be written",
                                value=len(led._pending))
