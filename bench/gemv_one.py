"""One GEMV shape launched a few times, for a profiler (Nsight Compute) to pick a launch of: no timing of its own.

python3 bench/gemv_one.py FMT SHAPE ROWS [VARIANT] [--shapes 27b|9b]
e.g. `ncu --clock-control none --kernel-name regex:gemv_mma_nvfp4 --launch-skip 3 --launch-count 1
--section SpeedOfLight --section WarpStateStats python3 bench/gemv_one.py nvfp4 gate_up 32`.
SHAPE is a bench/gemv.py projection name; VARIANT as bench/gemv.py's (default: the engine's choice).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import make_linear  # noqa: E402
from bench.gemv import SHAPES, SHAPES_9B  # noqa: E402
from tandem.backend.cuda import gemv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fmt")
    ap.add_argument("shape")
    ap.add_argument("rows", type=int)
    ap.add_argument("variant", nargs="?", default="")
    ap.add_argument("--shapes", default="27b")
    ap.add_argument("--launches", type=int, default=6)
    args = ap.parse_args()
    out_dim, in_dim = (SHAPES if args.shapes == "27b" else SHAPES_9B)[args.shape]
    lin = make_linear(args.fmt, out_dim, in_dim)
    xs = gemv.prepare(cp.random.standard_normal((args.rows, in_dim), dtype=cp.float32), lin.prep_kind)
    y = cp.empty((args.rows, out_dim), dtype=cp.float32)
    for _ in range(args.launches):
        lin.matmul_prepared(xs, out=y, variant=args.variant)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
