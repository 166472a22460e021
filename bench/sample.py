"""The device sampler alone (tandem/backend/cuda/sample.py, cuda/sample.cu) on one row of Qwen3.5's vocabulary:
µs a call for a flat row (random normal logits: top-p keeps most of the row) and a peaked one (a few logits 15
above a normal tail, as a model's), at the engine's settings, against the argmax; and apply_penalties (in place
on the row, so it runs after the sampler timings).
Usage: python3 bench/sample.py [--vocab 248320] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from tandem.backend.cuda.sample import apply_penalties, sample_rows  # noqa: E402

SETTINGS = {"greedy": (0.0, 0, 1.0, 0.0), "T 1.0": (1.0, 0, 1.0, 0.0), "T 0.8 top-p 0.9": (0.8, 0, 0.9, 0.0),
            "T 0.6 top-k 20 top-p 0.95 (Qwen)": (0.6, 20, 0.95, 0.0), "T 1.0 min-p 0.1": (1.0, 0, 1.0, 0.1)}


def time_us(fn: object, reps: int = 50) -> float:
    """Median µs of fn() by CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()  # type: ignore[operator]
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()  # type: ignore[operator]
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    flat = rng.standard_normal((1, args.vocab)).astype(np.float32) * 2
    peaked = flat.copy()
    peaked[0, rng.integers(0, args.vocab, 5)] += 15.0
    result: dict[str, dict[str, float]] = {}
    for name, row in (("flat", flat), ("peaked", peaked)):
        dev = cp.asarray(row)
        ids = cp.empty(1, cp.int32)
        noise = cp.empty(1, cp.float32)
        result[name] = {s: round(time_us(lambda: sample_rows(dev, *p, 7, [1000], out=ids, noise_out=noise)), 1)
                        for s, p in SETTINGS.items()}
        counts = cp.zeros(args.vocab, cp.int32)
        prompt = cp.zeros(args.vocab, cp.uint8)
        prev = cp.asarray([5], dtype=cp.int32)
        result[name]["apply_penalties (rep 1.1, presence 0.5)"] = round(time_us(
            lambda: apply_penalties(dev[0], counts, prompt, 1.1, 0.0, 0.5, prev=prev)), 1)
        print(name, result[name], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                              "vocab": args.vocab, "us_per_row": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
