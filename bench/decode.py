"""Plain decode on the GPU with synthetic checkpoints of Qwen3.5-9B's and -27B's shapes, built from the CUDA kernels.

Weights are random, generated on the device (never shipped): BF16, FP8 block-scaled (128×128) and NVFP4 (E2M1 +
E4M3 per 16 + fp32 global). One decode step = embedding row, 32 layers (GDN ×3 then attention, repeated), final
norm, head, argmax on the device; the layer loop is Python launching the kernels of tandem.backend.cuda.

Reports, per format: ms per token (eager Python launches, and one CUDA-graph replay of the captured step),
bytes read per step (weights as stored + GDN state read and written + KV rows read), achieved GB/s and its
fraction of the device-to-device copy bandwidth measured in the same run (bytes read + written), kernel
launches per step and per layer, and the device time of the step's projections for 4/8/16/32 rows of x over 1 row
(the matrix part of a verify). Usage: python3 bench/decode.py [--shapes 9b,27b] [--formats bf16,fp8,nvfp4]
[--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from tandem.backend.cuda import argmax, attention_decode, gdn_step, gemv, rms_norm, silu_mul  # noqa: E402

QWEN35_9B = dict(layers=32, hidden=4096, mlp=12288, vocab=248320, heads=16, kv_heads=4, head_dim=256,
                 gdn_k_heads=16, gdn_v_heads=32, gdn_dim=128, conv_taps=4, attn_every=4, rotary_dim=64)
QWEN35_27B = dict(layers=64, hidden=5120, mlp=17408, vocab=248320, heads=24, kv_heads=4, head_dim=256,
                  gdn_k_heads=16, gdn_v_heads=48, gdn_dim=128, conv_taps=4, attn_every=4, rotary_dim=64)
SHAPES = {"9b": QWEN35_9B, "27b": QWEN35_27B}
EPS = 1e-6
LAUNCHERS = (argmax, attention_decode, gdn_step, gemv, rms_norm, silu_mul)


class Counter:
    """Counts kernel launches by wrapping each launcher module's `kernel` lookup (one lookup = one launch)."""

    def __init__(self) -> None:
        self.count = 0
        for mod in LAUNCHERS:
            orig = mod.kernel

            def counted(stem: str, name: str, _orig: Any = orig) -> Any:
                self.count += 1
                return _orig(stem, name)

            mod.kernel = counted  # type: ignore[attr-defined]


class KernelTimes:
    """Device time per kernel name over one step: each launch bracketed by two events (a profile, not a speed
    figure: the brackets add gaps). Installed over Counter's wrappers; `report()` syncs and sums in ms."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, Any]] = []
        self.on = False
        for mod in LAUNCHERS:
            orig = mod.kernel

            def timed(stem: str, name: str, _orig: Any = orig) -> Any:
                fn = _orig(stem, name)
                if not self.on:
                    return fn

                def launch(*args: Any, **kwargs: Any) -> Any:
                    start, stop = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    res = fn(*args, **kwargs)
                    stop.record()
                    self.events.append((name, start, stop))
                    return res
                return launch

            mod.kernel = timed  # type: ignore[attr-defined]

    def report(self) -> dict[str, list[float]]:
        cp.cuda.Device().synchronize()
        out: dict[str, list[float]] = {}
        for name, start, stop in self.events:
            entry = out.setdefault(name, [0.0, 0])
            entry[0] += cp.cuda.get_elapsed_time(start, stop)
            entry[1] += 1
        self.events = []
        return {k: [round(v[0], 4), int(v[1])] for k, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def make_linear(fmt: str, out_dim: int, in_dim: int) -> Any:
    """A random device Linear of the given format (values of a trained model's order of magnitude)."""
    if fmt == "bf16":
        w = cp.random.standard_normal((out_dim, in_dim), dtype=cp.float32) * np.float32(0.02)
        return gemv.CudaDenseLinear((w.view(cp.uint32) >> 16).astype(cp.uint16))
    if fmt == "fp8":
        codes = cp.random.randint(0, 256, (out_dim, in_dim), dtype=cp.uint8)
        codes = cp.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).astype(cp.uint8)  # no NaN codes
        grid = (-(-out_dim // 128), -(-in_dim // 128))
        return gemv.CudaFP8BlockLinear(codes, cp.random.uniform(1e-4, 2e-4, grid).astype(cp.float32))
    packed = cp.random.randint(0, 256, (out_dim, in_dim // 2), dtype=cp.uint8)
    scales = cp.random.randint(0x28, 0x38, (out_dim, in_dim // 16), dtype=cp.uint8)
    return gemv.CudaNVFP4Linear(packed, scales, 0.01)


def build(fmt: str, c: dict[str, int], max_len: int) -> dict[str, Any]:
    e, f = c["hidden"], c["mlp"]
    hk, hv, dg = c["gdn_k_heads"], c["gdn_v_heads"], c["gdn_dim"]
    h, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    conv_dim = 2 * hk * dg + hv * dg
    ones = cp.ones(e, dtype=cp.float32)
    layers = []
    for i in range(c["layers"]):
        # projections of one input share a launch (gemv.concat): gate|up, q|k|v, qkv|z|a|b
        lw: dict[str, Any] = {"gate_up": gemv.concat([make_linear(fmt, f, e), make_linear(fmt, f, e)]),
                              "down": make_linear(fmt, e, f), "input_norm": ones, "post_norm": ones}
        if (i + 1) % c["attn_every"] == 0:
            lw.update(kind="attn", qkv=gemv.concat([make_linear(fmt, 2 * h * d, e), make_linear(fmt, hkv * d, e),
                                                    make_linear(fmt, hkv * d, e)]), o=make_linear(fmt, e, h * d),
                      q_norm=cp.ones(d, cp.float32), k_norm=cp.ones(d, cp.float32),
                      kc=cp.random.standard_normal((max_len, hkv, d), dtype=cp.float32),
                      vc=cp.random.standard_normal((max_len, hkv, d), dtype=cp.float32))
        else:
            lw.update(kind="gdn", proj=gemv.concat([make_linear(fmt, conv_dim, e), make_linear(fmt, hv * dg, e),
                                                    make_linear(fmt, hv, e), make_linear(fmt, hv, e)]),
                      out=make_linear(fmt, e, hv * dg),
                      conv_w=cp.random.standard_normal((conv_dim, c["conv_taps"]), dtype=cp.float32) * 0.3,
                      tail=cp.random.standard_normal((c["conv_taps"] - 1, conv_dim), dtype=cp.float32),
                      a_log=cp.zeros(hv, cp.float32), dt_bias=cp.zeros(hv, cp.float32),
                      norm_w=cp.ones(dg, cp.float32),
                      state=cp.random.standard_normal((hv, dg, dg), dtype=cp.float32) * 0.1)
        layers.append(lw)
    embed = (cp.random.standard_normal((c["vocab"], e), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    inv = cp.asarray(attention_decode.inv_freq(c["rotary_dim"], 1e7))
    return {"layers": layers, "embed": embed, "norm": ones, "head": make_linear(fmt, c["vocab"], e), "inv_freq": inv}


def _split(y: Any, sizes: tuple[int, ...]) -> list[Any]:
    out, start = [], 0
    for n in sizes:
        out.append(y[0, start:start + n])
        start += n
    return out


def decode_step(m: dict[str, Any], c: dict[str, int], ids: Any, pos: int) -> Any:
    """One token: ids [1] int32 on the device -> next ids [1] int32 on the device (no host sync)."""
    x = (m["embed"][ids].astype(cp.uint32) << 16).view(cp.float32)  # [1, E]
    delta = None
    f = c["mlp"]
    for lw in m["layers"]:
        hdn = rms_norm.rms_norm(x, lw["input_norm"], EPS) if delta is None else \
            rms_norm.add_rms_norm(x, delta, lw["input_norm"], EPS)
        if lw["kind"] == "gdn":
            mixed, z, a, b = _split(lw["proj"].matmul(hdn), lw["proj"].splits)
            y = gdn_step.gdn_decode_step(mixed, lw["tail"], lw["conv_w"], a, b, lw["a_log"], lw["dt_bias"],
                                         z, lw["norm_w"], lw["state"], c["gdn_k_heads"], EPS)
            delta = lw["out"].matmul(y[None])
        else:
            qg, k, v = _split(lw["qkv"].matmul(hdn), lw["qkv"].splits)
            y = attention_decode.attention_decode_step(
                qg.reshape(c["heads"], 2 * c["head_dim"]), k.reshape(c["kv_heads"], c["head_dim"]),
                v.reshape(c["kv_heads"], c["head_dim"]), lw["q_norm"], lw["k_norm"], m["inv_freq"], lw["kc"],
                lw["vc"], pos, EPS)
            delta = lw["o"].matmul(y[None])
        h2 = rms_norm.add_rms_norm(x, delta, lw["post_norm"], EPS)
        gu = lw["gate_up"].matmul(h2)
        delta = lw["down"].matmul(silu_mul.silu_mul(gu[:, :f], gu[:, f:]))
    hf = rms_norm.add_rms_norm(x, delta, m["norm"], EPS)
    return argmax.argmax(m["head"].matmul(hf))


def bytes_per_step(m: dict[str, Any], c: dict[str, int], pos: int) -> int:
    """Weights as stored + embedding row + GDN state (read + written) + KV rows read (pos + 1 of each)."""
    total = m["head"].bytes_per_use + 2 * c["hidden"]
    for lw in m["layers"]:
        total += sum(v.bytes_per_use for v in lw.values() if hasattr(v, "bytes_per_use"))
        if lw["kind"] == "gdn":
            total += 2 * lw["state"].nbytes
        else:
            total += 2 * (pos + 1) * c["kv_heads"] * c["head_dim"] * 4
    return int(total)


def time_ms(fn: Any, reps: int) -> float:
    """Median over `reps` of one call's device time (events), after the caller's warm-up."""
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(statistics.median(times))


def copy_bandwidth_gbps() -> float:
    n = 4 << 30
    src = cp.random.randint(0, 256, n, dtype=cp.uint8)
    dst = cp.empty_like(src)
    cp.copyto(dst, src)
    ms = time_ms(lambda: cp.copyto(dst, src), 10)
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * n / ms / 1e6


def gemv_rows_ms(m: dict[str, Any], rows: int) -> float:
    """Device time of every projection of one step (prepare + GEMV, weights read once) for `rows` rows of x:
    the matrix part of a `rows`-node verify (the mixers' tree kernels are timed by the engine bench)."""
    lins = [m["head"]] + [v for lw in m["layers"] for v in lw.values() if hasattr(v, "matmul_prepared")]
    xs_by_in = {}
    for lin in lins:
        key = (lin.shape[1], lin.prep_kind)
        if key not in xs_by_in:
            x = cp.random.standard_normal((rows, lin.shape[1]), dtype=cp.float32)
            xs_by_in[key] = gemv.prepare(x, lin.prep_kind)
    outs = {id(lin): cp.empty((rows, lin.shape[0]), dtype=cp.float32) for lin in lins}

    def run() -> None:
        for lin in lins:
            lin.matmul_prepared(xs_by_in[(lin.shape[1], lin.prep_kind)], out=outs[id(lin)])

    run()
    return time_ms(run, 10)


def bench_format(fmt: str, c: dict[str, int], counter: Counter, pos: int, rows: list[int],
                 times: KernelTimes | None = None) -> dict[str, Any]:
    m = build(fmt, c, max_len=pos + 64)
    ids = cp.zeros(1, dtype=cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # one stream throughout: CuPy's memory pool keeps free blocks per stream
        for _ in range(3):  # warm-up: compiles, fills the memory pool
            decode_step(m, c, ids, pos)
        stream.synchronize()
        before = counter.count
        decode_step(m, c, ids, pos)
        launches = counter.count - before
        eager = time_ms(lambda: decode_step(m, c, ids, pos), 10)
        profile = None
        if times is not None:
            times.on = True
            decode_step(m, c, ids, pos)
            times.on = False
            profile = times.report()
    graph_ms = None
    try:
        with stream:
            stream.begin_capture()
            decode_step(m, c, ids, pos)
            graph = stream.end_capture()
            graph.launch()
            stream.synchronize()
            graph_ms = time_ms(lambda: graph.launch(), 20)
    except Exception as exc:  # graph capture is a measurement aid; report why it failed
        print(f"{fmt}: graph capture failed: {exc!r}")
    nbytes = bytes_per_step(m, c, pos)
    best = graph_ms if graph_ms is not None else eager
    base = gemv_rows_ms(m, 1)
    ratios = {str(r): round(gemv_rows_ms(m, r) / base, 3) for r in rows}
    del m
    cp.get_default_memory_pool().free_all_blocks()
    return {"ms_per_token_eager": round(eager, 4), "ms_per_token_graph": None if graph_ms is None else round(graph_ms, 4),
            "bytes_per_step": nbytes, "achieved_GBps": round(nbytes / best / 1e6, 1),
            "launches_per_step": launches, "launches_per_layer": round(launches / c["layers"], 2),
            "gemv_ms_1_row": round(base, 4), "gemv_rows_over_1_row": ratios, "kernel_ms_count": profile}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="bf16,fp8,nvfp4")
    ap.add_argument("--pos", type=int, default=128, help="decode position (KV rows visible - 1)")
    ap.add_argument("--shapes", default="9b,27b")
    ap.add_argument("--rows", default="4,8,16,32", help="row counts for the verify-GEMV ratio")
    ap.add_argument("--profile", action="store_true", help="also time each kernel of one step (events)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    counter = Counter()
    times = KernelTimes() if args.profile else None
    t0 = time.time()
    copy_gbps = copy_bandwidth_gbps()
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    result: dict[str, Any] = {"device": name, "command": "python3 bench/decode.py " + " ".join(sys.argv[1:]),
                              "pos": args.pos, "copy_GBps": round(copy_gbps, 1), "shapes": {}}
    print(f"device {name}: copy {copy_gbps:.0f} GB/s (read + written)")
    rows = [int(r) for r in args.rows.split(",") if r]
    for shape in args.shapes.split(","):
        c = SHAPES[shape]
        res: dict[str, Any] = {"config": c, "formats": {}}
        result["shapes"][shape] = res
        for fmt in args.formats.split(","):
            r = bench_format(fmt, c, counter, args.pos, rows, times)
            r["fraction_of_copy"] = round(r["achieved_GBps"] / copy_gbps, 3)
            res["formats"][fmt] = r
            print(f"{shape} {fmt:6s} eager {r['ms_per_token_eager']:.3f} ms  graph {r['ms_per_token_graph']} ms  "
                  f"{r['bytes_per_step'] / 1e9:.2f} GB/step  {r['achieved_GBps']:.0f} GB/s  "
                  f"{100 * r['fraction_of_copy']:.0f}% of copy  {r['launches_per_step']} launches "
                  f"({r['launches_per_layer']}/layer)  gemv rows/1-row {r['gemv_rows_over_1_row']}", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["wall_s"] = round(time.time() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
