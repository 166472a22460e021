"""The RMSNorm kernels alone on the GPU (cuda/rms_norm.cu): µs a call of add_rms_norm (the residual norm of verify
and prefill rows, tile-order sum of squares) and rms_norm, at rows of --cols columns, fp32 and split (f16p) output;
device time of a CUDA-graph replay of 16 calls (a measurement aid). Random inputs on the device.
Usage: python3 bench/norm.py [--cols 5120] [--rows 1,8,32,64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from bench.fusion import graph_us  # noqa: E402
from tandem.backend.cuda.rms_norm import add_rms_norm, rms_norm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cols", type=int, default=5120)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                              "command": "python3 bench/norm.py " + " ".join(sys.argv[1:]), "us": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        x = cp.asarray(rng.standard_normal((rows, args.cols)).astype(np.float32))
        d = cp.asarray(rng.standard_normal((rows, args.cols)).astype(np.float32))
        w = cp.asarray((1 + 0.1 * rng.standard_normal(args.cols)).astype(np.float32))
        got = {f"add_rms_norm/{split or 'fp32'}": graph_us(lambda: add_rms_norm(x, d, w, 1e-6, split=split), 16)
               for split in (None, "f16p")}
        got.update({f"rms_norm/{split or 'fp32'}": graph_us(lambda: rms_norm(x, w, 1e-6, split=split), 16)
                    for split in (None, "f16p")})
        result["us"][str(rows)] = {k: round(v, 2) for k, v in got.items()}
        print(f"rows {rows}: " + "  ".join(f"{k} {v:.2f} us" for k, v in got.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
