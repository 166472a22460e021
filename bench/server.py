"""Server overhead: TTFT and decode tok/s through `tandem serve` (streamed, openai client) vs the Engine called
directly, same prompt, same seed, same token count. Reports the overhead ratios and writes bench/results/.

    python bench/server.py [MODEL] [--max-tokens 256] [--runs 5] [--out bench/results/server_<name>.json]

With no MODEL it builds the tiny random test model (tests/server_fixtures.py) in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from openai import OpenAI  # noqa: E402

from tandem.engine import Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a short story about a city in the rain."}]


def direct(engine: Engine, max_tokens: int, seed: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, tokens) with Engine.generate, timed from the call."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first, n = None, 0
    for chunk in engine.generate(PROMPT, params):
        first = first if first is not None else time.perf_counter()
        n += len(chunk.token_ids)
    t1 = time.perf_counter()
    assert first is not None
    return first - t0, (n - 1) / (t1 - first), n


def served(client: OpenAI, model: str, max_tokens: int, seed: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, tokens) through the server: first content/reasoning delta, streamed."""
    t0 = time.perf_counter()
    first, last, n = None, t0, 0
    stream = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=max_tokens, seed=seed,  # type: ignore[arg-type]
                                            temperature=1.0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        for c in chunk.choices:
            if c.delta.content or getattr(c.delta, "reasoning_content", None):
                first = first if first is not None else now
                last = now
    assert first is not None
    return first - t0, (n - 1) / (last - first) if last > first else float("nan"), n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from server_fixtures import ServerProcess, make_model

    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(args.model) if args.model else make_model(Path(tmp.name) / "tiny")
    engine = Engine.from_pretrained(model_dir)
    server = ServerProcess(model_dir, "--max-context", "4096")
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
        name = client.models.list().data[0].id
        direct(engine, 8, 0), served(client, name, 8, 0)  # warm-up
        rows: dict[str, list[tuple[float, float, int]]] = {"direct": [], "server": []}
        for run in range(args.runs):
            rows["direct"].append(direct(engine, args.max_tokens, run))
            rows["server"].append(served(client, name, args.max_tokens, run))
    finally:
        server.stop()
        tmp.cleanup()
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    result: dict[str, Any] = {
        "model": str(args.model or "tiny random (tests/server_fixtures.py)"), "max_tokens": args.max_tokens,
        "runs": args.runs, "machine": platform.platform(), "python": platform.python_version(),
        "direct": {"ttft_ms": med["direct"][0] * 1e3, "tokens_per_s": med["direct"][1]},
        "server": {"ttft_ms": med["server"][0] * 1e3, "tokens_per_s": med["server"][1]},
        "ttft_overhead_ms": (med["server"][0] - med["direct"][0]) * 1e3,
        "ttft_ratio": med["server"][0] / med["direct"][0],
        "tokens_per_s_ratio": med["server"][1] / med["direct"][1],
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"server_{model_dir.name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
