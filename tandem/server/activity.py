"""Live activity: what the engine is doing now, for ``GET /v1/activity``, its event stream and the dashboard.

Each generating request is a ``LiveRequest`` from the moment its plan is made (it then waits for a slot) until its
response has ended: its slot, client, prompt / cached / generated tokens so far, time to first token, current decode
speed, tokens per round and the acceptance of its drafts, and how long it waited. Engine-wide: tokens and rounds
per second (one bucket a second over the last ``history_s`` seconds), the scheduler's running and waiting counts, the
joint rounds' passes, the prefix cache's tiers and hit rate, host and device memory.

Cost: the routes' trackers (tandem/server/drive.py) call ``on_chunk`` once a round, on the event loop thread, where
it adds a few integers and appends to a short deque; everything else is computed when a snapshot is asked for
(bench/activity.py measures the whole against a server with ``--activity off``). Every method runs on the event
loop thread, so nothing here takes a lock.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.generation import RoundStats

if TYPE_CHECKING:
    from tandem.server.scheduler import Scheduler

HISTORY_S = 600  # the per-second history kept: the last ten minutes
RECENT = 100  # finished requests kept for the per-request charts
RATE_WINDOW_S = 5  # the "now" rates average the last this many whole seconds
SPEED_CHUNKS = 16  # a request's current speed is taken over its last this many chunks
FINISHED_KEPT_S = 5.0  # a finished request whose response never ended (a stream not read) leaves the list then


@dataclass(eq=False)
class LiveRequest:
    """One generating request as the activity sees it (times are ``time.perf_counter`` seconds; TTFT and
    ``elapsed_s`` count from its arrival, as the request log's, ``wait_s`` from its plan to its slot).

    Attributes: num_drafted / num_accepted: draft tokens verified / accepted over its speculative rounds; recent:
    (time, generated tokens) of its last chunks, for its current speed.
    """

    id: int
    route: str
    client: str | None
    prompt_tokens: int
    arrived: float  # the request's arrival (its record's)
    queued_at: float  # its plan made: from here it waits for a slot
    admitted_at: float | None = None
    first_at: float | None = None
    finished_at: float | None = None
    slot: int | None = None
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_rounds: int = 0
    round_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    finish_reason: str | None = None
    recent: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=SPEED_CHUNKS))

    def observe(self, num_tokens: int, stats: RoundStats | None, t: float) -> None:
        """One chunk of ``num_tokens`` committed at ``t`` (``stats``: its round, None for prefill's token)."""
        self.generated_tokens += num_tokens
        if self.first_at is None:
            self.first_at = t
        if stats is not None:
            self.num_rounds += 1
            self.round_tokens += num_tokens
            if stats.num_nodes > 1:
                self.num_drafted += stats.num_nodes - 1
                self.num_accepted += max(0, num_tokens - 1)
        self.recent.append((t, self.generated_tokens))

    def tokens_per_s(self) -> float | None:
        """Decode speed over its last chunks (None before two chunks)."""
        if len(self.recent) < 2:
            return None
        (t0, n0), (t1, n1) = self.recent[0], self.recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def tokens_per_round(self) -> float | None:
        """Mean tokens committed a round (None before the first round)."""
        return self.round_tokens / self.num_rounds if self.num_rounds else None

    def acceptance(self) -> float | None:
        """Accepted share of the draft tokens verified (None without a speculative round)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    def phase(self) -> str:
        """"waiting" (for a slot), "prefill" (admitted, no token yet), "decode" or "finished"."""
        if self.finished_at is not None:
            return "finished"
        if self.admitted_at is None:
            return "waiting"
        return "prefill" if self.first_at is None else "decode"

    def as_dict(self, now: float) -> dict[str, Any]:
        """JSON-ready: times in seconds relative to ``now`` (``elapsed_s`` since it was queued)."""
        waited = (self.admitted_at if self.admitted_at is not None else now) - self.queued_at
        return {"id": self.id, "route": self.route, "client": self.client, "phase": self.phase(), "slot": self.slot,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens, "wait_s": round(waited, 4),
                "elapsed_s": round(now - self.arrived, 4),
                "ttft_s": round(self.first_at - self.arrived, 4) if self.first_at is not None else None,
                "tokens_per_s": _round(self.tokens_per_s()), "tokens_per_round": _round(self.tokens_per_round()),
                "acceptance": _round(self.acceptance()), "rounds": self.num_rounds,
                "finish_reason": self.finish_reason}


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


class Activity:
    """The live requests, the finished ones kept for the charts, and per-second token and round counts.

    Args:
        enabled: False (``--activity off``) makes ``open`` return None and every hook a no-op; the routes answer
            ``{"enabled": false}``.
        history_s: seconds of per-second history kept.
    """

    def __init__(self, enabled: bool = True, history_s: int = HISTORY_S) -> None:
        self.enabled = enabled
        self.history_s = history_s
        self.started = time.perf_counter()
        self._wall0 = time.time() - self.started  # perf_counter seconds -> Unix seconds
        self.live: dict[int, LiveRequest] = {}
        self.finished: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        self._next_id = 1
        self.num_finished = 0
        self.total_tokens = 0
        self.total_rounds = 0
        self._sec = int(self.started)  # the bucket being filled: its second, tokens, rounds
        self._tokens = 0
        self._rounds = 0
        self._history: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=history_s)

    # ------------------------------------------------------------------------------- hooks (drive.Tracker)
    def open(self, route: str, client: str | None, prompt_tokens: int, arrived: float) -> LiveRequest | None:
        """A request (arrived at ``arrived``, perf_counter seconds) whose plan is made and which now waits for a
        slot; None when the activity is off."""
        if not self.enabled:
            return None
        live = LiveRequest(self._next_id, route, client, prompt_tokens, arrived, time.perf_counter())
        self._next_id += 1
        self.live[live.id] = live
        return live

    def on_chunk(self, live: LiveRequest | None, num_tokens: int, stats: RoundStats | None, t: float) -> None:
        """One chunk of a request's first choice or another (``t``: perf_counter seconds when it was made)."""
        if live is None:
            return
        live.observe(num_tokens, stats, t)
        sec = int(t)
        if sec != self._sec:
            self._roll(sec)
        self._tokens += num_tokens
        self.total_tokens += num_tokens
        if stats is not None:
            self._rounds += 1
            self.total_rounds += 1

    def finish(self, live: LiveRequest | None, finish_reason: str | None) -> None:
        """Its last choice has finished: it is kept among the recent requests and leaves the live list when its
        response ends (``close``), or FINISHED_KEPT_S later."""
        if live is None or live.finished_at is not None:
            return
        live.finished_at = time.perf_counter()
        live.finish_reason = finish_reason
        self.num_finished += 1
        entry = live.as_dict(live.finished_at)
        entry["finished_at"] = round(self._wall0 + live.finished_at, 3)
        entry["tokens_per_s"] = _round(_mean_speed(live))
        self.finished.append(entry)

    def close(self, live: LiveRequest | None) -> None:
        """The request's response has ended (or it failed before it ran): it leaves the live list."""
        if live is not None:
            self.live.pop(live.id, None)

    def _roll(self, sec: int) -> None:
        """Close the current second's bucket (and empty ones up to ``sec``) and start ``sec``'s."""
        if sec < self._sec:
            return  # a chunk stamped before the bucket now open (threads' clocks race): counted in the open one
        self._history.append((self._sec, self._tokens, self._rounds))
        for s in range(max(self._sec + 1, sec - self.history_s), sec):
            self._history.append((s, 0, 0))
        self._sec, self._tokens, self._rounds = sec, 0, 0

    # ------------------------------------------------------------------------------- snapshots
    def history(self, after: float | None = None) -> list[list[float]]:
        """Per-second [unix second, tokens, rounds] of the whole seconds that ended, after the Unix second
        ``after`` (None: all kept)."""
        now = int(time.perf_counter())
        if now != self._sec:
            self._roll(now)
        offset = int(round(self._wall0))
        return [[s + offset, n, r] for s, n, r in self._history if after is None or s + offset > after]

    def rates(self) -> tuple[float, float]:
        """Tokens and rounds a second over the last RATE_WINDOW_S whole seconds."""
        now = int(time.perf_counter())
        if now != self._sec:
            self._roll(now)
        window = [b for b in self._history if b[0] >= now - RATE_WINDOW_S]
        return (sum(b[1] for b in window) / RATE_WINDOW_S, sum(b[2] for b in window) / RATE_WINDOW_S)

    def snapshot(self, scheduler: Scheduler, engine_info: dict[str, Any], history_after: float | None = None,
                 recent: bool = True) -> dict[str, Any]:
        """The body of ``GET /v1/activity`` (and of each stream event).

        Args:
            scheduler: the server's scheduler (slots, running, waiting, draining).
            engine_info: what ``engine_info`` gathered off the event loop (cache, joint rounds, memory).
            history_after: only the history seconds after this Unix second (a stream sends each second once).
            recent: include the finished requests kept (a stream sends them with its first event and then only
                those finished since).
        """
        now = time.perf_counter()
        for rid, live in list(self.live.items()):
            if live.finished_at is not None and now - live.finished_at > FINISHED_KEPT_S:
                del self.live[rid]
        tokens_s, rounds_s = self.rates()
        return {
            "object": "activity", "enabled": True, "time": round(self._wall0 + now, 3),
            "uptime_s": round(now - self.started, 3), "slots": scheduler.slots, "running": scheduler.num_running,
            "waiting": scheduler.num_waiting, "draining": scheduler.draining,
            "requests": [r.as_dict(now) for r in self.live.values() if r.finished_at is None],
            "totals": {"requests": self.num_finished, "generated_tokens": self.total_tokens,
                       "rounds": self.total_rounds},
            "rates": {"tokens_per_s": round(tokens_s, 3), "rounds_per_s": round(rounds_s, 3)},
            "history": self.history(history_after),
            "recent": list(self.finished) if recent else [],
            **engine_info,
        }


def _mean_speed(live: LiveRequest) -> float | None:
    """A finished request's decode speed: tokens after the first over the time since the first."""
    if live.first_at is None or not live.recent:
        return None
    t_last = live.recent[-1][0]
    return (live.generated_tokens - 1) / (t_last - live.first_at) if t_last > live.first_at else None


def engine_info(engine: Any) -> dict[str, Any]:
    """The engine-wide part of a snapshot: the prefix cache (tiers' entries and bytes, hits, reused tokens), the
    joint rounds' passes and items, host and device memory. It takes the cache's lock, so the routes call it off
    the event loop."""
    cache = engine.cache.info() if engine.cache is not None else None
    if cache is not None:
        looked = cache["hits"] + cache["misses"]
        seen = cache["reused_tokens"] + cache["prefilled_tokens"]
        cache = {"enabled": True, "tiers": cache["tiers"], "hits": cache["hits"], "misses": cache["misses"],
                 "hit_rate": cache["hits"] / looked if looked else None, "reused_tokens": cache["reused_tokens"],
                 "prefilled_tokens": cache["prefilled_tokens"],
                 "reused_share": cache["reused_tokens"] / seen if seen else None}
    rounds = engine.rounds
    return {"model": engine.name, "spec": engine.spec_mode,
            "cache": cache if cache is not None else {"enabled": False},
            "joint": {"passes": rounds.passes, "items": rounds.items} if rounds is not None else None,
            "memory": {"host_rss_bytes": host_rss_bytes(), "device": device_memory()}}


def host_rss_bytes() -> int | None:
    """This process's resident memory in bytes (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import resource

    return pages * resource.getpagesize()


def device_memory() -> dict[str, int] | None:
    """The current GPU's memory (used, total; CuPy's pool: used, held) when CuPy is already loaded (a CUDA engine);
    None otherwise. It never imports CuPy: a CPU server does not load it."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        return {"used_bytes": int(total - free), "total_bytes": int(total), "pool_used_bytes": int(pool.used_bytes()),
                "pool_held_bytes": int(pool.total_bytes())}
    except Exception:  # no device in this process after all, or a driver error: memory is not shown
        return None
