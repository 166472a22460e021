"""What live activity and the usage ledger cost: decode tok/s through `tandem serve` with both on (and a client
following /v1/activity/stream, as the dashboard does) against a server with `--activity off --ledger off`, in one
run, and against a control: a second server with both off. The three answer in turn, request by request, the order
rotating, so all see the same machine load; the control's gap to the first (two identical processes) is the noise
floor the cost is read against. ``--instances K`` starts fresh processes K times (a process's own speed, where its
pages and threads landed, differs by several % on a small shared CPU). Also the bookkeeping's own cost per round,
timed alone (Activity.on_chunk and the tracker's counters), as a share of a round.

    python bench/activity.py [MODEL] [--max-tokens 256] [--pairs 8] [--instances 1]
        [--out bench/results/activity_cpu.json]
    python bench/activity.py --synthetic 27b:nvfp4 --out bench/results/activity_27b_nvfp4_h100.json   (a GPU)

With no MODEL it serves the embedded default model on the CPU, one slot (plain decode: the most rounds a second,
so the largest share for a per-round cost). ``--synthetic SHAPE:FORMAT`` serves bench/synthetic_server.py's random
model of that shape on the GPU instead (three servers, one model each, on one card), where a round is steadier than
on a shared CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from server_fixtures import ServerProcess  # noqa: E402

from tandem.generation import RoundStats  # noqa: E402
from tandem.server.activity import Activity  # noqa: E402

EMBEDDED = ROOT / "tandem" / "assets" / "default"
PROMPT = "Once upon a time, in a city by the sea,"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) the process has used so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gpu_name() -> str:
    """The first GPU's name (nvidia-smi), or "" where there is none."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


def decode_speed(server: ServerProcess, max_tokens: int, cpu: list[float] | None = None) -> float:
    """Decode tok/s of one streamed completion: tokens after the first over the time from the first to the last.
    With ``cpu``, the server's CPU milliseconds a token over the whole request are appended to it (less sensitive
    to other processes' load than the wall clock)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.0}
    times = []
    c0 = cpu_seconds(server.proc.pid)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError("the stream carried fewer than two tokens")
    if cpu is not None:
        cpu.append((cpu_seconds(server.proc.pid) - c0) / len(times) * 1e3)
    return (len(times) - 1) / (times[-1] - times[0])


def follow(server: ServerProcess, stop: threading.Event, events: list[int]) -> None:
    """Read /v1/activity/stream every second until `stop`, counting its events (the dashboard's load)."""
    with httpx.stream("GET", server.url + "/v1/activity/stream?interval=1", timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events[0] += 1
            if stop.is_set():
                return


def bookkeeping_us(n: int = 200_000) -> float:
    """Microseconds a round of bookkeeping takes alone (Activity.on_chunk for a one-token round)."""
    act = Activity()
    live = act.open("chat", None, 10, time.perf_counter())
    stats = RoundStats(1, 1)
    t0 = time.perf_counter()
    for _ in range(n):
        act.on_chunk(live, 1, stats, time.perf_counter())
    return (time.perf_counter() - t0) / n * 1e6


def snapshot_ms(n: int = 200) -> float:
    """Milliseconds one stream event takes to build and serialise (a full ten-minute history, 4 live requests,
    100 finished), the engine-wide part left out (the cache's info(), read in a thread)."""
    import orjson

    from tandem.server.scheduler import Scheduler
    from tandem.server.metrics import Metrics

    act = Activity()
    stats = RoundStats(2, 4)
    t = time.perf_counter() - 700
    for i in range(104):
        live = act.open("chat", f"client{i % 3}", 100, t)
        for k in range(50):
            act.on_chunk(live, 2, stats, t + i * 6 + k * 0.1)
        if i < 100:
            act.finish(live, "length")
            act.close(live)
    sched = Scheduler(8, 60.0, Metrics(), 4)
    t0 = time.perf_counter()
    for _ in range(n):
        orjson.dumps(act.snapshot(sched, {"cache": {"enabled": False}}))
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(EMBEDDED))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=8, help="rounds: a request to each server, the order rotating")
    ap.add_argument("--instances", type=int, default=1,
                    help="fresh server processes this many times (a process's own speed is part of the noise)")
    ap.add_argument("--synthetic", default=None, metavar="SHAPE:FORMAT", help="e.g. 27b:nvfp4 (GPU)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "activity_cpu.json"))
    args = ap.parse_args()
    common: tuple[str, ...] = ("--device", "cpu", "--parallel", "1", "--max-context", "2048", "--cache", "off")
    command = None
    if args.synthetic:
        shape, fmt = args.synthetic.split(":")
        # three servers on one card: the prefill's bf16 weights per call, not resident (54 GB at the 27B shape)
        command = [sys.executable, str(ROOT / "bench" / "synthetic_server.py"), "--shape", shape, "--format", fmt,
                   "--prefill-weights", "layer"]
        common = ("--parallel", "1", "--max-context", "2048", "--cache", "off")
    names = ["off", "on", "control"]
    speeds: dict[str, list[float]] = {k: [] for k in names}
    cpu_ms: dict[str, list[float]] = {k: [] for k in names}
    rows = events = 0
    for inst in range(args.instances):
        with tempfile.TemporaryDirectory() as tmp:
            flags = {"on": ("--ledger", str(Path(tmp) / "usage.sqlite"))}
            servers = {name: ServerProcess(Path(args.model), *common,
                                           *flags.get(name, ("--activity", "off", "--ledger", "off")),
                                           command=command, ready_timeout_s=900.0)
                       for name in (names if inst % 2 == 0 else names[::-1])}  # started in either order
            stop, seen = threading.Event(), [0]
            watcher = threading.Thread(target=follow, args=(servers["on"], stop, seen), daemon=True)
            watcher.start()
            try:
                for server in servers.values():
                    decode_speed(server, 16)  # warm
                for i in range(args.pairs):
                    for name in names[i % 3:] + names[:i % 3]:  # each server first, second and third in turn
                        speeds[name].append(decode_speed(servers[name], args.max_tokens, cpu_ms[name]))
                    print(f"instance {inst + 1} round {i + 1}: " + ", ".join(
                        f"{k} {speeds[k][-1]:.2f} tok/s {cpu_ms[k][-1]:.2f} cpu ms/token" for k in names), flush=True)
                rows += len(httpx.get(servers["on"].url + "/v1/usage?limit=100000", timeout=60).json()["data"])
                events += seen[0]
            finally:
                stop.set()
                for server in servers.values():
                    server.stop()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    cost = 1 - med["on"] / med["off"]
    noise = 1 - med["control"] / med["off"]
    cpu_med = {k: statistics.median(v) for k, v in cpu_ms.items()}
    cpu_cost = cpu_med["on"] / cpu_med["off"] - 1
    cpu_noise = cpu_med["control"] / cpu_med["off"] - 1
    per_round_us = bookkeeping_us()
    event_ms = snapshot_ms()
    round_ms = 1e3 / med["on"]
    result: dict[str, Any] = {
        "what": "decode tok/s through tandem serve: activity + ledger + a stream follower on vs both off",
        "model": args.synthetic or Path(args.model).name, "device": "cuda" if args.synthetic else "cpu",
        "machine": gpu_name() if args.synthetic else platform.processor() or platform.machine(),
        "max_tokens": args.max_tokens, "rounds": args.pairs, "instances": args.instances, "tok_s": speeds,
        "median_tok_s": med, "cost_share": round(cost, 4), "control_share": round(noise, 4),
        "server_cpu_ms_per_token": cpu_ms, "median_server_cpu_ms_per_token": cpu_med,
        "cpu_cost_share": round(cpu_cost, 4), "cpu_control_share": round(cpu_noise, 4),
        "stream_events_read": events, "ledger_rows": rows,
        "bookkeeping_us_per_round": round(per_round_us, 3),
        "bookkeeping_share_of_round": round(per_round_us / (round_ms * 1e3), 6),
        "stream_event_ms": round(event_ms, 3), "stream_event_share_of_a_second": round(event_ms / 1e3, 6),
    }
    print(f"median decode: off {med['off']:.2f} tok/s, on {med['on']:.2f} tok/s: on costs {cost * 100:+.2f} %; the "
          f"control (off again, another process) {med['control']:.2f} tok/s: {noise * 100:+.2f} % (the noise floor)")
    print(f"median server CPU a token: off {cpu_med['off']:.3f} ms, on {cpu_med['on']:.3f} ms: on costs "
          f"{cpu_cost * 100:+.2f} %; the control {cpu_med['control']:.3f} ms: {cpu_noise * 100:+.2f} %")
    print(f"bookkeeping alone: {per_round_us:.2f} us a round = {result['bookkeeping_share_of_round'] * 100:.4f} % "
          f"of a {round_ms:.1f} ms round")
    print(f"a stream event (full history, 4 live, 100 finished): {event_ms:.3f} ms built and serialised, once a "
          f"second = {event_ms / 10:.3f} % of one core")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
