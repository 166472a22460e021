"""GEMV (cuda/gemv.cu v2) alone on Qwen3.5-27B's (or 9B's) projection shapes: GB/s per shape and format, and the tuning
variants (chunks in flight per warp; for --rows > 1 the verify kernels). Random weights generated on the device. Usage:
python3 bench/gemv.py [--out FILE.json]. Reports weight bytes per call over the median device time (events
around a CUDA-graph replay of 12 calls, so Python's launch cost is left out: a kernel measurement),
against the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import copy_bandwidth_gbps, make_linear, time_ms  # noqa: E402
from tandem.backend.cuda import gemv  # noqa: E402

SHAPES = {"gdn_proj": (10240 + 6144 + 96, 5120), "gdn_out": (5120, 6144), "gate_up": (34816, 5120),
          "down": (5120, 17408), "head": (248320, 5120)}
SHAPES_9B = {"gdn_proj": (8192 + 4096 + 64, 4096), "gdn_out": (4096, 4096), "gate_up": (24576, 4096),
             "down": (4096, 12288), "head": (248320, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="bf16,fp8,nvfp4")
    ap.add_argument("--variants", default=None, help="comma list (one row may add resnorm, resnorm_nopf: the "
                    "residual + norm epilogue, without the register-prefetch kernel, out = hidden shapes only); "
                    "default: one-row tuning variants, or for --rows > 1 "
                    "the wide and staged verify kernels (gemv.WIDE_VARIANTS, gemv.STAGED_VARIANTS); staged variants a format lacks are "
                    "skipped")
    ap.add_argument("--rows", default="1", help="comma list of x row counts (verify trees: 4, 8, 16, 32)")
    ap.add_argument("--shapes", default="27b", help="27b or 9b: whose projection shapes")
    ap.add_argument("--only", default="", help="comma list of shape names to run (default: all)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    shapes = SHAPES if args.shapes == "27b" else SHAPES_9B
    hidden = shapes["gdn_out"][0]  # the hidden size: the out dim of the residual + norm GEMVs
    copy = copy_bandwidth_gbps()
    res: dict[str, Any] = {"copy_GBps": round(copy, 1), "command": "python3 bench/gemv.py " + " ".join(sys.argv[1:]),
                           "GBps": {}}
    print(f"copy {copy:.0f} GB/s")
    for fmt in args.formats.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            variants = args.variants if args.variants is not None else (
                ",_u2,_u4,_pf" if rows == 1 else "," + ",".join(gemv.WIDE_VARIANTS + gemv.STAGED_VARIANTS[fmt]))
            for name, (out_dim, in_dim) in shapes.items():
                if args.only and name not in args.only.split(","):
                    continue
                lins = [make_linear(fmt, out_dim, in_dim) for _ in range(3)]  # rotate: beat the 60 MB L2
                cp.cuda.Device().synchronize()  # the weights are made on the default stream: not under the timing
                xs = gemv.prepare(cp.random.standard_normal((rows, in_dim), dtype=cp.float32), lins[0].prep_kind)
                y = cp.empty((rows, out_dim), dtype=cp.float32)
                for variant in variants.split(","):
                    if gemv.is_staged(variant) and variant not in gemv.STAGED_VARIANTS[fmt]:
                        continue  # a staged instance this format does not have (shared memory)
                    if gemv.is_cm(variant) and fmt not in gemv.CM_VARIANTS:
                        continue  # class-major kernels exist for FP8 and NVFP4
                    if variant.startswith("resnorm") and (rows > 1 or out_dim != hidden):
                        continue  # the residual + norm epilogue: one row, out = the hidden size
                    resid = cp.random.standard_normal((1, out_dim), dtype=cp.float32)
                    norm_w = cp.ones((out_dim,), dtype=cp.float32)

                    def run() -> None:
                        for lin in lins:
                            if variant.startswith("resnorm"):  # the residual + norm epilogue
                                pf = gemv.RESNORM_PF
                                if variant == "resnorm_nopf":  # without the register-prefetch kernel
                                    gemv.RESNORM_PF = ()
                                lin.matmul_residual_norm(xs, resid, norm_w, 1e-6, split="f16")
                                gemv.RESNORM_PF = pf
                            else:
                                lin.matmul_prepared(xs, out=y, variant=variant)
                    run()
                    stream = cp.cuda.Stream(non_blocking=True)
                    with stream:  # a graph of the launches: kernel time without Python's launch cost
                        stream.begin_capture()
                        for _ in range(4):
                            run()
                        graph = stream.end_capture()
                        graph.launch()
                        stream.synchronize()
                        ms = time_ms(graph.launch, 20) / (4 * len(lins))
                    gbps = lins[0].bytes_per_use / ms / 1e6
                    key = f"{args.shapes}/{fmt}/{name}/{variant or 'default'}" + (f"/rows{rows}" if rows > 1 else "")
                    res["GBps"][key] = round(gbps, 1)
                    print(f"{key:28s} {ms * 1e3:9.1f} us  {gbps:7.0f} GB/s  {100 * gbps / copy:5.1f}% of copy",
                          flush=True)
                del lins
                cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
