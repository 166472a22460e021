"""What the decode-bits invariant costs the prefill GEMMs: the engine's warpgroup kernel against an unconstrained one.

The engine's multi-row GEMMs (cuda/gemv.cu gemv_mma_<fmt>_wg8s3, FP8 and NVFP4) give every row the decode GEMV's
bits: x is split into fp16 hi + lo parts, two MMA columns a token (DESIGN.md, "matrix rows"). The unconstrained
kernel of the same shape rounds x to one fp16 operand, one MMA column a token: gemv.cu compiled with
TANDEM_X_ONE_PART (a module of this script's own, never the engine's), whose gemv_mma_<fmt>_wg4s3 does for 32 tokens
the MMAs _wg8s3 does with the split, with the same grid, stages, weight stream and epilogue (the launcher's own
arguments: its kernel lookup is redirected). Its results differ from the engine's by x's fp16 rounding (reported,
relative error; a sanity check that it computes the product, not a figure).

At the 27B shapes (each projection of a layer, fused as the model loads them), for 64 / 128 / 256-row prefill
pieces: device time (a CUDA graph of 8 calls, median of 20 replays: bench/fusion.py graph_us) of both kernels,
TFLOPS (2 · T · out · in) and their fraction of the dense tensor-core peak measured in the same run
(bench/wgmma_peak.py), and a whole piece through every projection of the model's 64 layers (the LM head runs once a prompt, not counted): the invariant's cost = engine / unconstrained
- 1. Hopper (sm_90) only.

python3 bench/prefill_gemm.py [--formats fp8,nvfp4] [--rows 64,128,256] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench import wgmma_peak  # noqa: E402
from bench.decode import QWEN35_27B, make_linear  # noqa: E402
from bench.fusion import graph_us  # noqa: E402
from tandem.backend.cuda import gemv, loader  # noqa: E402

ENGINE_VARIANT = "_wg8s3"  # gemv.WGMMA's choice at 5-8 column tiles (17+ rows) for these shapes
FREE_VARIANT = "_wg4s3"  # its TANDEM_X_ONE_PART twin: half the MMA columns, the same 32 tokens a block


def projections(c: dict[str, int]) -> list[tuple[str, int, int, int, bool]]:
    """(name, out, in, layers using it, glu) of every projection of the model, fused as the model loads them."""
    e, f, hv, dg, hk = c["hidden"], c["mlp"], c["gdn_v_heads"], c["gdn_dim"], c["gdn_k_heads"]
    h, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    attn = c["layers"] // c["attn_every"]
    gdn = c["layers"] - attn
    return [("gdn.in_qkv|z|a|b", 2 * hk * dg + 2 * hv * dg + 2 * hv, e, gdn, False),
            ("gdn.out", e, hv * dg, gdn, False),
            ("attn.q|k|v", 2 * h * d + 2 * hkv * d, e, attn, False),
            ("attn.o", e, h * d, attn, False),
            ("mlp.gate|up", 2 * f, e, c["layers"], True),
            ("mlp.down", e, f, c["layers"], False)]


def free_module() -> Any:
    """gemv.cu built with TANDEM_X_ONE_PART for this device (sm_90a), a module apart from the engine's."""
    capability = loader.compute_capability()
    options = loader.nvrtc_options("gemv", capability) + ("-DTANDEM_X_ONE_PART",)
    module = cp.RawModule(code=loader.kernel_source("gemv"), options=options)
    module.compile()
    return module


class Redirect:
    """While on, gemv's lookups of gemv_mma_<fmt>_wg8s3[_glu] return the free module's _wg4s3 twin (counted)."""

    def __init__(self, module: Any) -> None:
        self.module, self.on, self.swaps = module, False, 0
        self.orig = gemv.kernel
        gemv.kernel = self.lookup  # type: ignore[assignment]

    def lookup(self, stem: str, name: str) -> Any:
        m = re.fullmatch(rf"gemv_mma_(fp8|nvfp4){ENGINE_VARIANT}(_glu)?", name)
        if self.on and stem == "gemv" and m:
            self.swaps += 1
            return self.module.get_function(f"gemv_mma_{m[1]}{FREE_VARIANT}{m[2] or ''}")
        return self.orig(stem, name)


def linear(fmt: str, out_dim: int, in_dim: int, glu: bool) -> Any:
    if glu:
        return gemv.glu_pair(make_linear(fmt, out_dim // 2, in_dim), make_linear(fmt, out_dim // 2, in_dim))
    return make_linear(fmt, out_dim, in_dim)


def one_part(xs: Any) -> Any:
    """An operand buffer of xs's shape [T, 2, in] whose first T rows (as the free kernel reads it: [T, 1, in]) are
    x's fp16 hi parts: x rounded to one fp16 operand."""
    t = int(xs.shape[0])
    buf = cp.zeros_like(xs)
    buf.reshape(2 * t, -1)[:t] = xs[:, 0, :]
    return buf


def bench_shape(fmt: str, lin: Any, rows: int, redirect: Redirect, peak: float) -> dict[str, Any]:
    out_dim, in_dim = lin.shape
    x = cp.random.standard_normal((rows, in_dim), dtype=cp.float32)
    xs = gemv.prepare(x, lin.prep_kind)
    xs1 = one_part(xs)
    y_out = out_dim // 2 if lin.glu else out_dim
    y, y1 = cp.empty((rows, y_out), cp.float32), cp.empty((rows, y_out), cp.float32)

    def engine() -> None:
        lin.matmul_prepared(xs, out=y, variant=ENGINE_VARIANT)

    def free() -> None:
        redirect.on = True
        lin.matmul_prepared(xs1, out=y1, variant=ENGINE_VARIANT)
        redirect.on = False

    before = redirect.swaps
    for _ in range(3):
        engine()
        free()
    if redirect.swaps == before:
        raise RuntimeError(f"{fmt} {lin.shape}: the free kernel was never launched")
    ms_e, ms_f = graph_us(engine) / 1e3, graph_us(free) / 1e3  # a graph of 8 calls: no Python launch gaps
    engine()
    free()
    err = float(cp.linalg.norm(y1 - y) / cp.linalg.norm(y))
    flops = 2.0 * rows * out_dim * in_dim
    return {"rows": rows, "engine_ms": round(ms_e, 4), "free_ms": round(ms_f, 4),
            "engine_tflops": round(flops / ms_e / 1e9, 1), "free_tflops": round(flops / ms_f / 1e9, 1),
            "engine_fraction_of_peak": round(flops / ms_e / 1e9 / peak, 3),
            "free_fraction_of_peak": round(flops / ms_f / 1e9 / peak, 3),
            "cost": round(ms_e / ms_f - 1, 3), "free_rel_error_vs_engine": round(err, 6),
            "engine_choice": gemv._verify_variant(fmt, -(-rows // 4), out_dim, in_dim)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp8,nvfp4")
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not gemv.wgmma_available():
        raise SystemExit("the warpgroup kernels need an sm_90 GPU")
    t0 = time.time()
    peak = wgmma_peak.peak_tflops()
    redirect = Redirect(free_module())
    rows = [int(r) for r in args.rows.split(",") if r]
    result: dict[str, Any] = {"command": "python3 bench/prefill_gemm.py " + " ".join(sys.argv[1:]),
                              "peak_tflops": round(peak, 1), "engine_variant": ENGINE_VARIANT,
                              "free_variant": FREE_VARIANT + " (TANDEM_X_ONE_PART)", "formats": {}}
    print(f"tensor-core peak (bench/wgmma_peak.py, measured now): {peak:.0f} TFLOPS", flush=True)
    for fmt in args.formats.split(","):
        per_shape: dict[str, Any] = {}
        totals = {r: [0.0, 0.0, 0.0] for r in rows}  # engine ms, free ms, flops of a piece through the model
        for name, out_dim, in_dim, count, glu in projections(QWEN35_27B):
            lin = linear(fmt, out_dim, in_dim, glu)
            per_shape[name] = figs = [bench_shape(fmt, lin, r, redirect, peak) for r in rows]
            for f in figs:
                tot = totals[f["rows"]]
                tot[0] += count * f["engine_ms"]
                tot[1] += count * f["free_ms"]
                tot[2] += count * 2.0 * f["rows"] * out_dim * in_dim
                print(f"{fmt:5s} {name:17s} [{out_dim:5d} x {in_dim:5d}] T {f['rows']:3d}: engine {f['engine_ms']:.4f} "
                      f"ms ({100 * f['engine_fraction_of_peak']:.0f}% of peak), unconstrained {f['free_ms']:.4f} ms "
                      f"({100 * f['free_fraction_of_peak']:.0f}%), cost {100 * f['cost']:+.0f}%, x fp16 rounding "
                      f"{f['free_rel_error_vs_engine']:.1e}", flush=True)
            del lin
            cp.get_default_memory_pool().free_all_blocks()
        model = {}
        for r, (e_ms, f_ms, flops) in totals.items():
            model[str(r)] = {"engine_ms": round(e_ms, 3), "free_ms": round(f_ms, 3), "cost": round(e_ms / f_ms - 1, 3),
                             "engine_fraction_of_peak": round(flops / e_ms / 1e9 / peak, 3),
                             "free_fraction_of_peak": round(flops / f_ms / 1e9 / peak, 3),
                             "engine_tok_per_s_gemms_only": round(r / e_ms * 1e3, 1),
                             "free_tok_per_s_gemms_only": round(r / f_ms * 1e3, 1)}
            print(f"{fmt:5s} a {r}-row piece through the 27B's 64 layers: engine {e_ms:.2f} ms, unconstrained "
                  f"{f_ms:.2f} ms: the invariant costs {100 * (e_ms / f_ms - 1):+.0f}% ({r / e_ms * 1e3:.0f} vs "
                  f"{r / f_ms * 1e3:.0f} tok/s of GEMMs alone)", flush=True)
        result["formats"][fmt] = {"projections": per_shape, "model_piece": model}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["wall_s"] = round(time.time() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
