"""Where the host time of one GPU decode step goes: cProfile over 30 engine-style decode steps of the CUDA model
on a synthetic Qwen3.5-9B (NVFP4). Usage: python3 bench/host_profile.py [--shape 9b] [--format nvfp4]."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import SHAPES, build  # noqa: E402
from tandem.backend.cuda import argmax  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--format", default="nvfp4")
    args = ap.parse_args()
    m = build(args.format, SHAPES[args.shape])
    state = m.new_state(256)
    m.prefill(state, list(range(100)))
    tok = 7

    def steps(n: int) -> None:
        nonlocal tok
        for _ in range(n):
            tok = int(argmax.argmax(m.decode(state, tok)[None])[0])

    steps(5)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    steps(30)
    print(f"{(time.perf_counter() - t0) / 30 * 1e3:.2f} ms per step (wall)")
    prof = cProfile.Profile()
    prof.enable()
    steps(30)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
