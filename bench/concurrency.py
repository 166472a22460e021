"""Several streams at once through the server (``--parallel`` slots): aggregate tok/s, each stream's TTFT and time
per token, at 1, 2, 4, 8 and 16 concurrent streams, with the official ``openai`` client (streaming completions).

Each stream sends its own prompt of ``--prompt-tokens`` tokens (distinct words, so no two share a cached prefix;
the prefix cache is off) and asks for ``--max-tokens`` tokens with ``ignore_eos``. A level's streams start together;
aggregate tok/s is the tokens they produced over the time from the first request sent to the last stream's end;
a stream's time per token is (end − first token) / (tokens − 1). The short-beside-long check: while one stream
generates, a short request (``--short-tokens`` prompt, 8 tokens) arrives; its TTFT is compared with the same
request alone (its own prefill) plus two decode rounds of the long stream.

    python3 bench/concurrency.py [--synthetic 27b:nvfp4] [--device cpu|cuda] [--streams 1,2,4,8,16]
        [--prompt-tokens 1024] [--max-tokens 128] [--spec off] [--out bench/results/concurrency_X.json]

``--synthetic SHAPE:FORMAT`` serves bench/synthetic_server.py's random model of that shape on the GPU; otherwise
``tandem serve`` of the embedded model (or ``--model``). The server runs with ``--parallel`` = the largest stream
count. With ``--out``, the JSON is written there and, where matplotlib is installed, a PNG of aggregate tok/s
against streams beside it. ``decode_tok_s``: the tokens every stream received while all of them were decoding (after
the last first token, up to the first end) over that span, the prefills left out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from openai import OpenAI  # noqa: E402

from server_fixtures import ServerProcess  # noqa: E402
from tandem.engine import DEFAULT_MODEL  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402

WORDS = ("alpha beta gamma delta river mountain window engine planet garden silver castle number letter bridge "
         "forest ocean yellow purple orange market school teacher doctor camera mirror pencil rocket").split()


def prompt_of(rng: random.Random, tok: Tokenizer, n: int) -> str:
    """A text of about n tokens (words drawn at random, so two prompts share no long prefix)."""
    words: list[str] = []
    while len(tok.encode(" ".join(words))) < n:
        words += [rng.choice(WORDS) for _ in range(max(8, (n - len(words)) // 2))]
    while len(words) > 1 and len(tok.encode(" ".join(words))) > n:
        words.pop()
    return " ".join(words)


def stream(client: OpenAI, prompt: str, max_tokens: int, go: threading.Barrier | None = None) -> dict[str, Any]:
    """One streamed completion: send time, first-token time, end time, token count, each text chunk's time."""
    if go is not None:
        go.wait()
    t0 = time.perf_counter()
    first = None
    n = 0
    times: list[float] = []  # when each text chunk arrived
    events = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for event in events:
        if event.usage is not None:
            n = event.usage.completion_tokens
        if event.choices and event.choices[0].text:
            times.append(time.perf_counter())
            first = first if first is not None else times[-1]
    t1 = time.perf_counter()
    return {"sent": t0, "first": first or t1, "end": t1, "tokens": n, "times": times}


def level(client: OpenAI, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """The streams of one level, started together."""
    go = threading.Barrier(len(prompts))
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda p: stream(client, p, max_tokens, go), prompts))
    start = min(r["sent"] for r in runs)
    wall = max(r["end"] for r in runs) - start
    tokens = sum(r["tokens"] for r in runs)
    tpt = [(r["end"] - r["first"]) / max(1, r["tokens"] - 1) for r in runs]
    # the decode rate: every stream's tokens after its first over the span when all of them were decoding (from the
    # last first token to the first end), the prefills left out
    both = max(r["first"] for r in runs), min(r["end"] for r in runs)
    decode_rate = len(prompts) / statistics.median(tpt) if both[1] <= both[0] else \
        sum(len([t for t in r["times"] if both[0] < t <= both[1]]) for r in runs) / (both[1] - both[0])
    return {"streams": len(prompts), "tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "decode_tok_s": decode_rate,
            "ttft_s": [r["first"] - r["sent"] for r in runs], "time_per_token_ms": [t * 1e3 for t in tpt],
            "median_time_per_token_ms": statistics.median(tpt) * 1e3}


def joint_counts(server: ServerProcess) -> tuple[float, float]:
    """(joint passes, slot rounds they carried) from /metrics (0, 0 without joint rounds)."""
    values = {"tandem_joint_passes_total": 0.0, "tandem_joint_slot_rounds_total": 0.0}
    for line in server.request("GET", "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return values["tandem_joint_passes_total"], values["tandem_joint_slot_rounds_total"]


def short_beside_long(client: OpenAI, long_prompt: str, short_prompt: str, max_tokens: int) -> dict[str, Any]:
    """A short request's TTFT alone, and arriving while a long stream generates."""
    alone = [stream(client, short_prompt, 8) for _ in range(2)][-1]
    result: dict[str, Any] = {}
    started = threading.Event()

    def long_run() -> None:
        t0 = time.perf_counter()
        first = None
        count = 0
        for event in client.completions.create(model="bench", prompt=long_prompt, max_tokens=max_tokens,
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True}):
            if event.choices and event.choices[0].text:
                first = first if first is not None else time.perf_counter()
                count += 1
                if count == 8:
                    started.set()
        result["long_round_ms"] = (time.perf_counter() - (first or t0)) / max(1, count - 1) * 1e3

    t = threading.Thread(target=long_run)
    t.start()
    started.wait(600)
    beside = stream(client, short_prompt, 8)
    t.join()
    ttft_alone = alone["first"] - alone["sent"]
    ttft_beside = beside["first"] - beside["sent"]
    return {"ttft_alone_s": ttft_alone, "ttft_beside_long_s": ttft_beside,
            "long_round_ms": result.get("long_round_ms"),
            "within_prefill_plus_two_rounds": ttft_beside <= ttft_alone + 2 * result.get("long_round_ms", 0) / 1e3}


def start(args: argparse.Namespace, parallel: int) -> ServerProcess:
    extra = ["--served-model-name", "bench", "--max-context", str(args.context)]
    command = None
    if args.synthetic:
        shape, fmt = args.synthetic.split(":")
        command = [sys.executable, str(ROOT / "bench" / "synthetic_server.py"), "--shape", shape, "--format", fmt,
                   "--cache", "off", "--parallel", str(parallel), "--spec", args.spec,
                   "--joint-planned", args.joint_planned, "--joint-batched", args.joint_batched,
                   "--spec-max-running", str(args.spec_max_running)]
    else:
        extra += ["--device", args.device, "--spec", args.spec, "--cache", "off", "--parallel", str(parallel),
                  "--max-queue", "64", "--spec-max-running", str(args.spec_max_running)]
    return ServerProcess(Path(args.model) if args.model else DEFAULT_MODEL, *extra, ready_timeout_s=1800.0,
                         command=command)


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for spec, rows in result["levels"].items():
        ax.plot([r["streams"] for r in rows], [r["aggregate_tok_s"] for r in rows], "o-", label=f"spec {spec}")
    base = next(iter(result["levels"].values()))[0]["aggregate_tok_s"]
    xs = [r["streams"] for r in next(iter(result["levels"].values()))]
    ax.plot(xs, [base * x for x in xs], ":", color="gray", label="linear in streams")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s")
    ax.set_title(f"{result['model']} on {result['device']}: {result['prompt_tokens']}-token prompts, "
                 f"{result['max_tokens']} tokens each", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--synthetic", default=None, metavar="SHAPE:FORMAT", help="e.g. 27b:nvfp4 (GPU)")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--spec", default="off", help="comma-separated speculation modes to run (off, lookup, ...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--joint-planned", default="on", choices=("on", "off"), help="with --synthetic (its flag)")
    ap.add_argument("--joint-batched", default="on", choices=("on", "off"), help="with --synthetic (its flag)")
    ap.add_argument("--spec-max-running", type=int, default=1,
                    help="the server's --spec-max-running (slots draft trees while at most this many run)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    counts = [int(n) for n in args.streams.split(",") if n]
    tok = Tokenizer.from_dir(DEFAULT_MODEL if not args.model else Path(args.model))
    assert tok is not None
    rng = random.Random(args.seed)
    levels: dict[str, list[dict[str, Any]]] = {}
    beside: dict[str, Any] = {}
    for spec in args.spec.split(","):
        server = start(argparse.Namespace(**{**vars(args), "spec": spec}), max(counts))
        try:
            client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
            stream(client, prompt_of(rng, tok, 64), 4)  # warm
            rows = []
            for n in counts:
                prompts = [prompt_of(rng, tok, args.prompt_tokens) for _ in range(n)]
                before = joint_counts(server)
                row = level(client, prompts, args.max_tokens)
                after = joint_counts(server)
                passes = after[0] - before[0]
                row["joint_passes"], row["mean_slots_a_pass"] = passes, (after[1] - before[1]) / max(1, passes)
                rows.append(row)
                print(json.dumps({"spec": spec, **{k: v for k, v in row.items() if not isinstance(v, list)}}),
                      flush=True)
            levels[spec] = rows
            beside[spec] = short_beside_long(client, prompt_of(rng, tok, args.prompt_tokens),
                                             prompt_of(rng, tok, args.short_tokens), 4 * args.max_tokens)
            print(json.dumps({"spec": spec, "short_beside_long": beside[spec]}), flush=True)
        except Exception:
            print("\n".join(["server log (last 60 lines):", *server.errors[-60:]]), file=sys.stderr, flush=True)
            raise
        finally:
            server.stop()
    one = {spec: rows[0] for spec, rows in levels.items()}
    result = {
        "model": args.synthetic or (Path(args.model).name if args.model else "default"),
        "device": "cuda" if args.synthetic else args.device, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "host": platform.node(), "cpu_count": os.cpu_count(),
        "joint_planned": args.joint_planned if args.synthetic else None,
        "joint_batched": args.joint_batched if args.synthetic else None,
        "spec_max_running": args.spec_max_running,
        "speedup_over_one_stream": {spec: {r["streams"]: r["aggregate_tok_s"] / one[spec]["aggregate_tok_s"]
                                           for r in rows} for spec, rows in levels.items()},
        "decode_speedup_over_one_stream": {spec: {r["streams"]: r["decode_tok_s"] / one[spec]["decode_tok_s"]
                                                  for r in rows} for spec, rows in levels.items()},
        "time_per_token_over_one_stream": {
            spec: {r["streams"]: r["median_time_per_token_ms"] / one[spec]["median_time_per_token_ms"]
                   for r in rows} for spec, rows in levels.items()},
        "short_beside_long": beside, "levels": levels}
    print(json.dumps({k: v for k, v in result.items() if k != "levels"}, indent=2))
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
