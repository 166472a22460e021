"""An agent conversation replayed through `tandem serve` with the official openai client, streaming, prefix cache
on against cache off in one run: TTFT per turn, tokens reused, cache bytes, and a PNG plot of TTFT per turn.

The conversation: a system prompt with tool schemas (``--system-tokens``), then turns that each add a user message
or a tool result (``--turn-min``..``--turn-max`` tokens of synthetic text) and stream a greedy reply of
``--max-tokens`` tokens (eos ignored, so both runs have the same lengths), until the context is full. Each reply goes
back into the history as the client would send it (its content only: Qwen3.5's template drops the reasoning of
earlier turns, so turn k+1 leaves turn k's ids inside the last assistant turn). Greedy replies must be equal with
the cache on and off (the cache is exact); the run checks it. ``--restart-at K`` (with ``--cache-dir``) restarts
the cache-on server before turn K, so that turn is served from the disk tier.

    python bench/conversation.py [--model PATH] [--device cpu|cuda] [--context 4096] [--max-tokens 32]
        [--out bench/results/conversation_cpu.json]   (the plot is written next to it as .png)

A checkpoint without tokenizer files (tools/make_checkpoint.py's synthetic 9B/27B shapes) is served through a
temporary folder linking its files, with the embedded model's tokenizer and chat template. ``--synthetic 27b:nvfp4``
serves bench/synthetic_server.py instead (the shape's random weights built on the GPU, seeded, the embedded
tokenizer and template; a restart rebuilds the same weights). ``--off-every K`` runs the cache-off server on
turns 0, K, 2K, ... and the last only, each with the cache-on run's history (its replies, which must equal the
cache-off replies there: checked), to bound a long context's run time. Not a test.

Agent turns at depth (``--turn-sizes``): ``--synthetic 27b:nvfp4 --context 65536 --system-tokens 30000 --turn-sizes
1000,1000,4000,16000 --max-tokens 16`` times turns that add 1k, 4k and 16k tokens to a 30k context (the first
turn warms the path).

    python bench/conversation.py --synthetic 27b:nvfp4 --context 32768 --system-tokens 4000 --turn-min 2000
        --turn-max 4000 --max-tokens 16 --cache-gb 8 --cache-dir /tmp/conv27 --restart-at 4 --off-every 4
        --out $OUT/conversation_27b_nvfp4.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from openai import OpenAI  # noqa: E402

from server_fixtures import ServerProcess  # noqa: E402
from tandem.chat import ChatTemplate  # noqa: E402
from tandem.engine import DEFAULT_MODEL  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402

WORDS = ("the file function returns value error line test module import class config request response cache "
         "state token prefix server client build path result output input check update list read write open "
         "close start stop time size data index item key name type error warning info debug").split()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def words(rng: random.Random, tok: Tokenizer, num_tokens: int) -> str:
    """Synthetic text of about ``num_tokens`` tokens (code-ish lines of common words)."""
    lines: list[str] = []
    while len(tok.encode("\n".join(lines))) < num_tokens:
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)))
    return "\n".join(lines)


def system_prompt(rng: random.Random, tok: Tokenizer, num_tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """Instructions plus tool schemas, about ``num_tokens`` tokens in all."""
    tools: list[dict[str, Any]] = []
    while len(tok.encode(json.dumps(tools))) < num_tokens * 3 // 4:
        i = len(tools)
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}_{rng.choice(WORDS)}", "description": " ".join(rng.choice(WORDS) for _ in range(30)),
            "parameters": {"type": "object", "properties": {
                f"{rng.choice(WORDS)}_{j}": {"type": rng.choice(["string", "integer", "boolean"]),
                                             "description": " ".join(rng.choice(WORDS) for _ in range(8))}
                for j in range(4)}, "required": []}}})
    return "You are a coding agent. Follow these rules.\n" + words(rng, tok, num_tokens // 4), tools


def model_dir(path: str | None, tmp: Path) -> Path:
    """The folder to serve: ``path`` itself when it has a tokenizer, else links to its files plus the embedded
    model's tokenizer and template."""
    root = Path(path) if path else DEFAULT_MODEL
    if (root / "tokenizer.json").is_file():
        return root
    out = tmp / "model"
    out.mkdir()
    for p in root.iterdir():
        (out / p.name).symlink_to(p.resolve())
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL / name).is_file():
            shutil.copy(DEFAULT_MODEL / name, out / name)
    return out


def turn(client: OpenAI, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int
         ) -> dict[str, Any]:
    """One streamed request: TTFT (first content or reasoning delta), total time, usage, the reply."""
    t0 = time.perf_counter()
    first = None
    content: list[str] = []
    usage: Any = None
    stream = client.chat.completions.create(
        model="bench", messages=messages, tools=tools, max_tokens=max_tokens, temperature=0,  # type: ignore
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content or getattr(c.delta, "reasoning_content", None) or c.delta.tool_calls:
                first = first if first is not None else time.perf_counter()
            if c.delta.content:
                content.append(c.delta.content)
    t1 = time.perf_counter()
    details = usage.prompt_tokens_details if usage is not None else None
    return {"ttft_s": (first or t1) - t0, "total_s": t1 - t0, "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": int(details.cached_tokens or 0) if details is not None else 0,
            "reply": "".join(content)}


def start(model: Path, args: argparse.Namespace, cache: str) -> ServerProcess:
    extra = ["--max-context", str(args.context), "--served-model-name", "bench", "--cache", cache]
    command = None
    if args.synthetic:
        shape, fmt = args.synthetic.split(":")
        command = [sys.executable, str(ROOT / "bench" / "synthetic_server.py"), "--shape", shape, "--format", fmt,
                   "--seed", str(args.seed)]
    else:
        extra += ["--device", args.device, "--spec", args.spec]
    if cache == "on":
        extra += ["--cache-gb", str(args.cache_gb)]
        if args.cache_host_gb is not None:
            extra += ["--cache-host-gb", str(args.cache_host_gb)]
        if args.prefix_chunk:
            extra += ["--prefix-chunk", str(args.prefix_chunk)]
        if args.cache_dir:
            extra += ["--cache-dir", args.cache_dir]
    t0 = time.perf_counter()
    proc = ServerProcess(model, *extra, ready_timeout_s=1800.0, command=command)
    print(f"cache {cache}: server up in {time.perf_counter() - t0:.1f} s", flush=True)
    return proc


def replay(model: Path, args: argparse.Namespace, cache: str, script: dict[str, Any],
           history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run the conversation on a fresh server; a row per turn. With ``history`` (another run's rows), only the
    turns --off-every picks are sent, each after that run's turns and replies."""
    tok = Tokenizer.from_dir(model)
    template = ChatTemplate.from_dir(model)
    assert tok is not None and template is not None
    proc = start(model, args, cache)
    rows: list[dict[str, Any]] = []
    last = len(history) - 1 if history is not None else -1
    try:
        messages: list[dict[str, Any]] = [{"role": "system", "content": script["system"]}]
        for k, (role, text) in enumerate(script["turns"]):
            nxt = messages + [{"role": "user", "content": text if role == "user" else
                               f"<tool_response>\n{text}\n</tool_response>"}]
            if history is not None:
                if k > last:
                    break
                if k % max(1, args.off_every) and k != last:
                    messages = nxt + [{"role": "assistant", "content": history[k]["reply"]}]
                    continue
            rendered = template.render(nxt, tools=script["tools"])
            if len(tok.encode(rendered)) + args.max_tokens >= args.context:
                break
            if cache == "on" and args.cache_dir and k == args.restart_at:
                proc.stop()
                proc = start(model, args, cache)
            client = OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=3600, max_retries=0)
            row = turn(client, nxt, script["tools"], args.max_tokens)
            info = proc.request("GET", "/v1/cache").json()
            row.update(turn=k, kind=role, added_tokens=len(tok.encode(text)), restarted=bool(
                cache == "on" and args.cache_dir and k == args.restart_at),
                cache_bytes={t: v["bytes"] for t, v in info.get("tiers", {}).items()})
            rows.append(row)
            print(f"cache {cache} turn {k}: prompt {row['prompt_tokens']} cached {row['cached_tokens']} "
                  f"ttft {row['ttft_s']:.3f} s", flush=True)
            messages = nxt + [{"role": "assistant", "content": row["reply"]}]
    except Exception:
        print("\n".join(["server log (last 60 lines):", *proc.errors[-60:]]), file=sys.stderr, flush=True)
        raise
    finally:
        proc.stop()
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for mode, style in (("off", "o-"), ("on", "s-")):
        rows = result["runs"][mode]
        ax.plot([r["prompt_tokens"] for r in rows], [r["ttft_s"] for r in rows], style, label=f"cache {mode}")
    for r in result["runs"]["on"]:
        if r["restarted"]:
            ax.annotate("restart (disk tier)", (r["prompt_tokens"], r["ttft_s"]), textcoords="offset points",
                        xytext=(0, 10), ha="center", fontsize=8)
    ax.set_xlabel("prompt tokens of the turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{result['model']} on {result['device']}: an agent conversation, TTFT per turn\n"
                 f"(load average {result['load_average_1m_at_end']:.0f} on {result['cpu_count']} cores at the end)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--turn-min", type=int, default=200)
    ap.add_argument("--turn-max", type=int, default=600)
    ap.add_argument("--turns", type=int, default=64, help="at most this many turns (the context ends it first)")
    ap.add_argument("--turn-sizes", default="",
                    help="comma-separated token counts of the turns, in order (instead of --turn-min/--turn-max): "
                    "e.g. 1000,4000,16000 after a 30000-token system prompt for agent turns at 30k context")
    ap.add_argument("--spec", default="off", choices=["off", "lookup", "mtp", "auto"])
    ap.add_argument("--prefix-chunk", type=int, default=None)
    ap.add_argument("--cache-gb", type=float, default=2.0)
    ap.add_argument("--cache-host-gb", type=float, default=None)
    ap.add_argument("--synthetic", default=None, metavar="SHAPE:FORMAT",
                    help="serve bench/synthetic_server.py's model (e.g. 27b:nvfp4, 27b:fp8) instead of --model")
    ap.add_argument("--off-every", type=int, default=1,
                    help="the cache-off run measures turns 0, K, 2K, ... and the last only (1: every turn)")
    ap.add_argument("--cache-dir", default=None, help="disk tier for the cache-on run (with --restart-at)")
    ap.add_argument("--restart-at", type=int, default=-1, help="restart the cache-on server before this turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model, Path(tmp))
        tok = Tokenizer.from_dir(model)
        assert tok is not None
        rng = random.Random(args.seed)
        system, tools = system_prompt(rng, tok, args.system_tokens)
        sizes = [int(n) for n in args.turn_sizes.split(",") if n] or \
            [rng.randint(args.turn_min, args.turn_max) for _ in range(args.turns)]
        turns = [("user" if k % 2 == 0 else "tool", words(rng, tok, n)) for k, n in enumerate(sizes)]
        script = {"system": system, "tools": tools, "turns": turns}
        if args.cache_dir:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
        on = replay(model, args, "on", script)
        if args.out:  # the cache-on run alone, in case the cache-off run is cut short
            Path(args.out).write_text(json.dumps({"partial": True, "runs": {"on": on}}, indent=2) + "\n")
        off = replay(model, args, "off", script, on if args.off_every > 1 else None)
        runs = {"on": on, "off": off}
    by_turn = {r["turn"]: r for r in on}
    pairs = [(by_turn[b["turn"]], b) for b in off if b["turn"] in by_turn]
    result = {
        "model": args.synthetic or (Path(args.model).name if args.model else "default"),
        "device": "cuda" if args.synthetic and not args.synthetic.startswith("embedded") else args.device,
        "spec": args.spec,
        "context": args.context, "max_tokens": args.max_tokens, "prefix_chunk": args.prefix_chunk,
        "cache_gb": args.cache_gb, "cache_host_gb": args.cache_host_gb, "off_every": args.off_every,
        "host": platform.node(), "cpu_count": os.cpu_count(), "load_average_1m_at_end": os.getloadavg()[0],
        "identical_replies": len(pairs) == len(off) and all(a["reply"] == b["reply"] for a, b in pairs),
        "compared_turns": [b["turn"] for _, b in pairs],
        "ttft_ratio_on_over_off": [a["ttft_s"] / b["ttft_s"] for a, b in pairs],
        "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
