"""CPU prefill benchmark: the model's one-pass prefill against the engine's chunked prefill with the prefix cache
off, on (snapshots taken on the grid: their cost on a cold request) and restored (a resend, and a resend plus
``--extra`` new tokens).

    python bench/prefill_cpu.py [--model PATH] [--tokens 1772] [--chunk 256] [--runs 3]
        [--json bench/results/prefill_cpu.json]

Times are the best of ``--runs`` (the machine may be shared); TTFT is from the call to the first chunk. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.cache.store import GB, PrefixCache  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft(engine: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    for _ in engine.generate(ids, ONE):
        return time.perf_counter() - t0
    raise RuntimeError("no chunk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1772)
    ap.add_argument("--extra", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = Engine.from_pretrained(args.model, cache="off", prefix_chunk=args.chunk)
    model = base.model
    ids = np.random.default_rng(0).integers(0, base.vocab_size, args.tokens + args.extra).tolist()
    prompt, longer = ids[:args.tokens], ids

    def best(fn: Any) -> float:
        return min(fn() for _ in range(args.runs))

    def one_pass() -> float:
        state = model.new_state(args.tokens)
        t0 = time.perf_counter()
        model.prefill(state, prompt)
        return time.perf_counter() - t0

    def cold_on() -> float:
        engine = Engine(model, None, None, None, (), "m", "off", PrefixCache(args.chunk, 2 * GB), args.chunk)
        return ttft(engine, prompt)

    warm = Engine(model, None, None, None, (), "m", "off", PrefixCache(args.chunk, 2 * GB), args.chunk)
    ttft(warm, prompt)
    out = {
        "model": base.name, "tokens": args.tokens, "prefix_chunk": args.chunk, "runs": args.runs,
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average_1m_at_start": os.getloadavg()[0],
        "model_prefill_one_pass_s": best(one_pass),
        "engine_cache_off_ttft_s": best(lambda: ttft(base, prompt)),
        "engine_cache_on_cold_ttft_s": best(cold_on),
        "engine_resend_ttft_s": best(lambda: ttft(warm, prompt)),
        f"engine_resend_plus_{args.extra}_ttft_s": best(lambda: ttft(warm, longer)),
    }
    out["prefill_tokens_per_s"] = args.tokens / out["model_prefill_one_pass_s"]
    out["snapshot_overhead_fraction"] = out["engine_cache_on_cold_ttft_s"] / out["engine_cache_off_ttft_s"] - 1
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
