"""Prefill on tensor cores (tandem/models/qwen3_5/cuda_prefill.py) on synthetic checkpoints of Qwen3.5-27B's and
-9B's shapes (bench/decode.py ``build``: random weights generated on the device, projections fused as on load).

Reports, per shape and format: the engine's prefill of prompts of ``--prompts`` tokens (one ``prefill`` call on a
fresh state, host wall time after a warm-up, synchronized; tok/s and TTFT), in each ``--weights`` mode (bf16 weights
dequantised per call, or kept resident); then one chunk's parts at ``--chunk`` rows, each timed alone with events
over random inputs: every projection's cuBLAS bf16 GEMM (TFLOP/s; the same call the engine makes, so it is the
cuBLAS ceiling at that shape in this run), the dequantisation of the whole model's weights, the flash attention at
the chunk's first position 0 and at ``--deep`` (TFLOP/s: 2 · 2 · H · D · keys a query row, causal), the GDN prefill of
the chunk (conv, scan, gated norm: decode's scan, each recurrent scan variant and the chunked WY scan at each
precision, ms a layer and µs a token and layer), and the sum of a chunk's parts against the chunk's measured time.
``--gdn-scan`` picks the engine prefill's GDN scan ("recurrent", "chunked", or both, each timed in the same run).
The device-to-device copy bandwidth and the card's name are recorded in the same run.
Usage: python3 bench/prefill.py [--shapes 27b,9b] [--formats nvfp4,fp8,bf16] [--prompts 1024,4096,8192,32768]
[--weights layer,resident,auto] [--gdn-scan recurrent,chunked] [--kv-dtype bfloat16] [--chunk 4096] [--deep 28672]
[--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import SHAPES, build, copy_bandwidth_gbps, time_ms  # noqa: E402
from tandem.backend.cuda.attention_decode import inv_freq  # noqa: E402
from tandem.backend.cuda.attention_flash import attention_flash_prefill  # noqa: E402
from tandem.backend.cuda.gdn_chunk import PRECISIONS, new_workspace, supports  # noqa: E402
from tandem.backend.cuda.gdn_prefill import VARIANTS, gdn_prefill_chunk  # noqa: E402
from tandem.backend.cuda.gdn_seq import gdn_prefill, new_rows  # noqa: E402
from tandem.backend.cuda.prefill_gemm import MIN_ROWS, bf16_weight, gemm_b16, weight_shape  # noqa: E402
from tandem.models.qwen3_5.cuda_model import _GDN  # noqa: E402
from tandem.models.qwen3_5.cuda_prefill import TensorCorePrefill  # noqa: E402


def flops_per_token(c: dict[str, int]) -> float:
    """2 · the projections' multiply-adds a token (the head's excluded: prefill computes it for the last token)."""
    e, f = c["hidden"], c["mlp"]
    hk, hv, dg = c["gdn_k_heads"], c["gdn_v_heads"], c["gdn_dim"]
    h, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    gdn = e * (2 * hk * dg + 2 * hv * dg + 2 * hv) + hv * dg * e
    attn = e * (2 * h * d + 2 * hkv * d) + h * d * e
    mlp = 3 * e * f
    n_attn = c["layers"] // c["attn_every"]
    return 2.0 * ((c["layers"] - n_attn) * gdn + n_attn * attn + c["layers"] * mlp)


def attention_flops(c: dict[str, int], start: int, rows: int) -> float:
    """Causal attention's FLOPs of ``rows`` query rows at positions start.. over every attention layer."""
    keys = rows * start + rows * (rows + 1) / 2
    return 4.0 * c["heads"] * c["head_dim"] * keys * (c["layers"] // c["attn_every"])


def prefill_wall_ms(model: Any, state: Any, ids: list[int], reps: int) -> float:
    times = []
    for _ in range(reps):
        state.reset()
        model.synchronize()
        t0 = time.perf_counter()
        model.prefill(state, ids)
        model.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def chunk_parts(model: Any, c: dict[str, int], rows: int, deep: int) -> dict[str, Any]:
    """One chunk's parts, each timed alone (module docstring)."""
    out: dict[str, Any] = {}
    shapes: dict[tuple[int, int], int] = {}
    lins = []
    for lw in model.layers:
        m = lw.mixer
        for lin in (m.proj, m.out if isinstance(m, _GDN) else m.o, lw.gate_up, lw.down):
            shapes[weight_shape(lin)] = shapes.get(weight_shape(lin), 0) + 1
            lins.append(lin)
    m_rows = max(MIN_ROWS, rows)
    gemm_total = 0.0
    for (n, k), count in sorted(shapes.items()):
        a = (cp.random.standard_normal((m_rows, k), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
        w = (cp.random.standard_normal((n, k), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
        y = cp.empty((m_rows, n), dtype=cp.float32)
        gemm_b16(a, w, y)
        ms = time_ms(lambda: gemm_b16(a, w, y), 5)
        tflops = 2.0 * m_rows * n * k / ms / 1e9
        out[f"gemm_{n}x{k}"] = {"ms": round(ms, 4), "tflops": round(tflops, 1), "per_chunk": count}
        gemm_total += ms * count
    out["gemm_ms_chunk"] = round(gemm_total, 3)
    scratch = cp.empty((max(n * k for n, k in shapes),), dtype=cp.uint16)
    bf16_weight(lins[0], out=scratch)
    out["dequant_ms_chunk"] = round(time_ms(lambda: [bf16_weight(lin, out=scratch) for lin in lins], 3), 3)
    hp = model.hp
    h, hkv, d = hp.num_attention_heads, hp.num_key_value_heads, hp.head_dim
    freq = cp.asarray(inv_freq(hp.rotary_dim, hp.rope_theta))
    n_attn = c["layers"] // c["attn_every"]
    for start in (0, deep):
        kc = (cp.random.standard_normal((start + rows, hkv, d), dtype=cp.float32).view(cp.uint32) >> 16
              ).astype(cp.uint16)
        vc = kc.copy()
        qg = cp.random.standard_normal((rows, h, 2 * d), dtype=cp.float32)
        kn = cp.random.standard_normal((rows, hkv, d), dtype=cp.float32)
        ones = cp.ones(d, cp.float32)

        def attn() -> None:
            attention_flash_prefill(qg, kn, kn, ones, ones, freq, kc, vc, start, 1e-6, split="b16")

        attn()
        ms = time_ms(attn, 3)
        fl = attention_flops(c, start, rows) / n_attn
        out[f"attention_at_{start}"] = {"ms_layer": round(ms, 3), "tflops": round(fl / ms / 1e9, 1),
                                        "ms_chunk": round(ms * n_attn, 2)}
    hk, hv, dg = hp.linear_num_key_heads, hp.linear_num_value_heads, hp.linear_key_head_dim
    conv = 2 * hk * dg + hv * dg
    mixed = cp.random.standard_normal((rows, conv), dtype=cp.float32)
    z = cp.random.standard_normal((rows, hv * dg), dtype=cp.float32)
    ab = cp.random.standard_normal((rows, hv), dtype=cp.float32)
    tail = cp.zeros((hp.linear_conv_kernel_dim - 1, conv), cp.float32)
    ssm = cp.zeros((hv, dg, dg), cp.float32)
    cw = cp.random.standard_normal((conv, hp.linear_conv_kernel_dim), dtype=cp.float32) * 0.3
    zero, one = cp.zeros(hv, cp.float32), cp.ones(dg, cp.float32)
    rows_buf = new_rows(rows, hk, hv, dg, dg)

    n_gdn = c["layers"] - n_attn

    def gdn_seq_scan() -> None:  # decode's arithmetic (the fallback prefill's scan)
        gdn_prefill(mixed, tail, cw, ab, ab, zero, zero, z, one, ssm, hk, 1e-6, rows=rows_buf, split="b16")

    variants: list[tuple[str, Any]] = [("gdn_seq", gdn_seq_scan)]
    for r in VARIANTS[dg]:
        def chunk(r: int = r) -> None:
            gdn_prefill_chunk(mixed, tail, cw, ab, ab, zero, zero, z, one, ssm, hk, 1e-6, rows=rows_buf,
                              split="b16", rows_per_lane=r)
        variants.append((f"gdn_chunk_r{r}", chunk))
    if supports(dg, dg):
        ws = new_workspace(rows, hv, dg, dg)
        for prec in PRECISIONS:
            def wy(prec: str = prec) -> None:
                gdn_prefill_chunk(mixed, tail, cw, ab, ab, zero, zero, z, one, ssm, hk, 1e-6, rows=rows_buf,
                                  split="b16", scan="chunked", precision=prec, workspace=ws)
            variants.append((f"gdn_wy_{prec}", wy))
    for name, fn in variants:
        fn()
        ms = time_ms(fn, 3)
        out[name] = {"ms_layer": round(ms, 3), "ms_chunk": round(ms * n_gdn, 2),
                     "us_token_layer": round(ms * 1e3 / rows, 4)}
    return out


def prefill_runs(model: Any, state: Any, c: dict[str, int], key: str, mode: str, scan: str, args: Any,
                 prompts: list[int], res: dict[str, Any]) -> None:
    """The engine's prefill of each prompt length in one weights mode with one GDN scan, into ``res``."""
    model._tc = TensorCorePrefill(model, args.chunk, mode, scan)
    assert model.tensor_core_prefill() is not None, "the tensor-core prefill is not ready"
    tag = mode if scan == "recurrent" else f"{mode}_{scan}"
    warm = np.random.default_rng(0).integers(0, c["vocab"], min(prompts)).tolist()
    prefill_wall_ms(model, state, warm, 1)
    for p in prompts:
        ids = np.random.default_rng(p).integers(0, c["vocab"], p).tolist()
        ms = prefill_wall_ms(model, state, ids, args.reps if p <= 32768 else 1)
        tf = (flops_per_token(c) * p + attention_flops(c, 0, p)) / ms / 1e9
        res[f"{tag}_{p}"] = {"ms": round(ms, 1), "tok_s": round(p / ms * 1e3, 1), "tflops": round(tf, 1)}
        print(f"{key} {tag:16s} prompt {p:6d}: {ms:9.1f} ms  {p / ms * 1e3:9.1f} tok/s  {tf:6.1f} TFLOP/s",
              flush=True)
    res[f"{tag}_weights"] = model._tc.weights  # "auto" settles on "resident" or "layer"
    if model._tc.weights == "resident":
        res["resident_gb"] = round(model._tc.resident_bytes() / 1e9, 2)
    model._tc = None
    cp.get_default_memory_pool().free_all_blocks()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="27b")
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--prompts", default="1024,4096,8192,32768")
    ap.add_argument("--weights", default="layer,resident")
    ap.add_argument("--gdn-scan", default="recurrent", help="the prefill's GDN scans to time: recurrent,chunked")
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=4096, help="rows of the tensor-core prefill's chunks")
    ap.add_argument("--deep", type=int, default=28672, help="a deep chunk's first position (the parts' attention)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-parts", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    props = cp.cuda.runtime.getDeviceProperties(0)
    result: dict[str, Any] = {"device": props["name"].decode(), "copy_gbps": round(copy_bandwidth_gbps(), 1),
                              "chunk": args.chunk, "results": {}}
    print(f"device {result['device']}, copy {result['copy_gbps']} GB/s", flush=True)
    prompts = [int(p) for p in args.prompts.split(",") if p]
    for shape in args.shapes.split(","):
        c = SHAPES[shape]
        for fmt in args.formats.split(","):
            model = build(fmt, c, args.kv_dtype)
            key = f"{shape}_{fmt}"
            res: dict[str, Any] = {"flops_per_token": flops_per_token(c)}
            state = model.new_state(max(prompts) + 8)
            for mode in args.weights.split(","):
                for scan in args.gdn_scan.split(","):
                    prefill_runs(model, state, c, key, mode, scan, args, prompts, res)
            if not args.no_parts:
                res["parts"] = chunk_parts(model, c, args.chunk, args.deep)
                print(f"{key} parts at {args.chunk} rows: {json.dumps(res['parts'])}", flush=True)
            result["results"][key] = res
            del model, state
            cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
