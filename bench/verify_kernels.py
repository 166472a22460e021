"""One tree verify (--decode: one decode step and its argmax) of the engine's CUDA model on a synthetic checkpoint,
bracketed by cudaProfilerStart / Stop, for Nsight Compute to time every kernel of it on the device (the engine's own
launches, a recorded plan replayed; no timing of its own). Gives the true kernel durations that bench/decode.py
--profile's events overstate (events around a launch also time the launcher's host work).

ncu --profile-from-start off --metrics gpu__time_duration.sum --csv python3 bench/verify_kernels.py [--shape 27b]
    [--fmt nvfp4] [--nodes 32] [--pos 128] [--decode | --prefill N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from bench.decode import SHAPES, build, random_tree  # noqa: E402
from tandem.backend.cuda import argmax  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--decode", action="store_true", help="profile one decode step (and its argmax) instead")
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens at --pos instead "
                    "(pieces end at multiples of 64, as the engine's)")
    args = ap.parse_args()
    c = SHAPES[args.shape]
    m = build(args.fmt, c)
    state = m.new_state(args.pos + max(80, args.prefill + 8))
    m.prefill(state, np.random.default_rng(0).integers(0, c["vocab"], args.pos).tolist())
    if args.prefill:
        ids = np.random.default_rng(1).integers(0, c["vocab"], args.prefill).tolist()
        for _ in range(2):  # warm-up: every kernel compiled and loaded
            m.prefill(state, ids)
            state.length = args.pos
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        m.prefill(state, ids)
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
        return
    if args.decode:
        for _ in range(3):  # the first records the decode plan; then replays
            argmax.argmax(m.decode(state, 7)[None])
            state.length -= 1
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        argmax.argmax(m.decode(state, 7)[None])
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
        return
    parents = random_tree(args.nodes, args.nodes)
    scratch = m.new_tree_scratch(args.nodes)
    ids = [int(t) for t in np.random.default_rng(args.nodes).integers(0, c["vocab"], args.nodes)]
    for _ in range(3):  # the first records the verify plan; then replays
        m.verify_tree(state, scratch, ids, parents)
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    m.verify_tree(state, scratch, ids, parents)
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()


if __name__ == "__main__":
    main()
