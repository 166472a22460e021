"""What the decode-bits invariant costs the prefill GEMMs: the engine's warpgroup kernel against an unconstrained one.

The engine's multi-row GEMMs (cuda/gemv.cu gemv_mma_<fmt>_wg8s3, FP8 and NVFP4) give every row the decode GEMV's
bits: x is split into fp16 hi + lo parts, two MMA columns a token (DESIGN.md, "matrix rows"), so a block's 64 MMA
columns hold 32 tokens. The unconstrained kernels of the same shape round x to one fp16 operand, one MMA column a
token: gemv.cu compiled with TANDEM_X_ONE_PART (a module of this script's own, never the engine's), in two forms,
each through the launcher's own arguments (its kernel lookup is redirected):
- "free32": gemv_mma_<fmt>_wg4s3, 32 tokens a block on 32 MMA columns: the same grid, stages, weight stream and
  epilogue, half the MMAs (what the second MMA of a product costs);
- "free64": gemv_mma_<fmt>_wg8s3, 64 tokens a block on 64 columns, half the token blocks: also half the weight
  decodes and weight reads a token (what the split costs a kernel that keeps its accumulator registers).
Their results differ from the engine's by x's fp16 rounding (reported as a relative error: a check that they
compute the product, not a figure).

At the 27B shapes (each projection of a layer, fused as the model loads them), for 64 / 128 / 256-row prefill
pieces: device time (a CUDA graph of 8 calls, median of 20 replays: bench/fusion.py graph_us) of the three,
TFLOPS (2 · T · out · in) and their fraction of the dense tensor-core peak measured in the same run
(bench/wgmma_peak.py), and a whole piece through every projection of the model's 64 layers (the LM head runs once
a prompt, not counted): the invariant's cost = engine / unconstrained - 1. Hopper (sm_90) only.

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
# TANDEM_X_ONE_PART kernels standing in for it: (kernel variant, tokens a block)
FREE = {"free32": ("_wg4s3", 32), "free64": ("_wg8s3", 64)}


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


class Launch:
    """A free kernel launched with the engine launcher's arguments, its grid's token blocks set to ceil(T / tokens)."""

    def __init__(self, fn: Any, rows: int, tokens: int) -> None:
        self.fn, self.blocks = fn, -(-rows // tokens)

    def __call__(self, grid: tuple[int, int], block: tuple[int], args: tuple[Any, ...], shared_mem: int = 0) -> None:
        self.fn((self.blocks, grid[1]), block, args, shared_mem=shared_mem)


class Redirect:
    """While `mode` names a FREE kernel, gemv's lookups of gemv_mma_<fmt>_wg8s3[_glu] return that kernel of the
    TANDEM_X_ONE_PART module (counted in `swaps`) for a launch of `rows` rows."""

    def __init__(self, module: Any) -> None:
        self.module, self.mode, self.rows, self.swaps = module, "", 0, 0
        self.orig, self.orig_smem = gemv.kernel, gemv.raise_smem_limit
        gemv.kernel = self.lookup  # type: ignore[assignment]
        gemv.raise_smem_limit = lambda fn, n: self.orig_smem(fn.fn if isinstance(fn, Launch) else fn, n)

    def lookup(self, stem: str, name: str) -> Any:
        m = re.fullmatch(rf"gemv_mma_(fp8|nvfp4){ENGINE_VARIANT}(_glu)?", name)
        if self.mode and stem == "gemv" and m:
            self.swaps += 1
            variant, tokens = FREE[self.mode]
            return Launch(self.module.get_function(f"gemv_mma_{m[1]}{variant}{m[2] or ''}"), self.rows, tokens)
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
    """Device ms, TFLOPS and the fraction of `peak` of the engine kernel and each FREE one for `rows` rows; each
    free one's cost figure (engine / free - 1) and its relative difference from the engine's product."""
    out_dim, in_dim = lin.shape
    x = cp.random.standard_normal((rows, in_dim), dtype=cp.float32)
    xs = gemv.prepare(x, lin.prep_kind)
    xs1 = one_part(xs)
    y_out = out_dim // 2 if lin.glu else out_dim
    flops = 2.0 * rows * out_dim * in_dim
    figs: dict[str, Any] = {"rows": rows, "engine_choice": gemv._verify_variant(fmt, -(-rows // 4), out_dim, in_dim)}
    y = cp.empty((rows, y_out), cp.float32)
    for mode in ("engine", *FREE):
        out = cp.empty_like(y)

        def run(mode: str = mode, out: Any = out) -> None:
            redirect.mode, redirect.rows = ("" if mode == "engine" else mode), rows
            lin.matmul_prepared(xs if mode == "engine" else xs1, out=y if mode == "engine" else out,
                                variant=ENGINE_VARIANT)
            redirect.mode = ""

        before = redirect.swaps
        for _ in range(3):
            run()
        if mode != "engine" and redirect.swaps == before:
            raise RuntimeError(f"{fmt} {lin.shape}: the {mode} kernel was never launched")
        ms = graph_us(run) / 1e3  # a graph of 8 calls: no Python launch gaps
        run()
        figs[mode] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                      "fraction_of_peak": round(flops / ms / 1e9 / peak, 3)}
        if mode != "engine":
            figs[mode]["cost"] = round(figs["engine"]["ms"] / ms - 1, 3)
            figs[mode]["rel_error_vs_engine"] = round(float(cp.linalg.norm(out - y) / cp.linalg.norm(y)), 6)
    return figs


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
                              "free_variants": {m: f"{v} (TANDEM_X_ONE_PART), {t} tokens a block"
                                                for m, (v, t) in FREE.items()}, "formats": {}}
    print(f"tensor-core peak (bench/wgmma_peak.py, measured now): {peak:.0f} TFLOPS", flush=True)
    for fmt in args.formats.split(","):
        per_shape: dict[str, Any] = {}
        modes = ("engine", *FREE)
        totals = {r: {m: 0.0 for m in (*modes, "flops")} for r in rows}  # ms of a piece through the model
        for name, out_dim, in_dim, count, glu in projections(QWEN35_27B):
            lin = linear(fmt, out_dim, in_dim, glu)
            per_shape[name] = figs = [bench_shape(fmt, lin, r, redirect, peak) for r in rows]
            for f in figs:
                tot = totals[f["rows"]]
                tot["flops"] += count * 2.0 * f["rows"] * out_dim * in_dim
                for m in modes:
                    tot[m] += count * f[m]["ms"]
                free = ", ".join(f"{m} {f[m]['ms']:.4f} ms ({100 * f[m]['fraction_of_peak']:.0f}%, cost "
                                 f"{100 * f[m]['cost']:+.0f}%, x rounding {f[m]['rel_error_vs_engine']:.1e})"
                                 for m in FREE)
                print(f"{fmt:5s} {name:17s} [{out_dim:5d} x {in_dim:5d}] T {f['rows']:3d}: engine "
                      f"{f['engine']['ms']:.4f} ms ({100 * f['engine']['fraction_of_peak']:.0f}% of peak); {free}",
                      flush=True)
            del lin
            cp.get_default_memory_pool().free_all_blocks()
        model: dict[str, Any] = {}
        for r, tot in totals.items():
            model[str(r)] = {m: {"ms": round(tot[m], 3),
                                 "fraction_of_peak": round(tot["flops"] / tot[m] / 1e9 / peak, 3),
                                 "tok_per_s_gemms_only": round(r / tot[m] * 1e3, 1),
                                 **({"cost": round(tot["engine"] / tot[m] - 1, 3)} if m != "engine" else {})}
                             for m in modes}
            print(f"{fmt:5s} a {r}-row piece through the 27B's 64 layers: engine {tot['engine']:.2f} ms "
                  f"({100 * model[str(r)]['engine']['fraction_of_peak']:.0f}% of peak); " + ", ".join(
                      f"{m} {tot[m]:.2f} ms ({100 * model[str(r)][m]['fraction_of_peak']:.0f}%): the invariant costs "
                      f"{100 * (tot['engine'] / tot[m] - 1):+.0f}%" for m in FREE), flush=True)
        result["formats"][fmt] = {"projections": per_shape, "model_piece": model}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["wall_s"] = round(time.time() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
