"""What each decode fusion costs or saves on the GPU: the fused kernel against the launches it replaces, on
Qwen3.5-27B shapes, device time of a CUDA-graph replay (a measurement aid; kernels only). Random weights on the
device. Usage: python3 bench/fusion.py [--out FILE.json]. Prints µs per call for each pair.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from bench.decode import make_linear, time_ms  # noqa: E402
from tandem.backend.cuda import gemv  # noqa: E402
from tandem.backend.cuda.attention_decode import attention_decode_step, inv_freq  # noqa: E402
from tandem.backend.cuda.gdn_seq import gdn_decode, gdn_prefill  # noqa: E402
from tandem.backend.cuda.rms_norm import add_rms_norm  # noqa: E402
from tandem.backend.cuda.silu_mul import silu_mul_rows  # noqa: E402

E, F = 5120, 17408


def none(*_: Any) -> None:
    """Swallow a launcher's result (the graph captures the launches)."""


def graph_us(fn: Callable[[], None], calls: int = 8) -> float:
    """Median device µs of one fn() call, replayed as a graph of `calls` calls."""
    fn()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(calls):
            fn()
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
        return 1e3 * time_ms(graph.launch, 20) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res: dict[str, Any] = {"command": "python3 bench/fusion.py " + " ".join(sys.argv[1:]), "us": {}}

    def report(name: str, us: float) -> None:
        res["us"][name] = round(us, 2)
        print(f"{name:48s} {us:8.2f} us", flush=True)

    kind = gemv.PREP_KIND[args.fmt]
    w = cp.ones(E, dtype=cp.float32)
    resid = cp.random.standard_normal((1, E), dtype=cp.float32)
    for name, in_dim in (("down", F), ("gdn_out", 6144)):
        lins = [make_linear(args.fmt, E, in_dim) for _ in range(3)]
        xs = gemv.prepare(cp.random.standard_normal((1, in_dim), dtype=cp.float32), kind)
        report(f"{name}: GEMV", graph_us(lambda: none([lin.matmul_prepared(xs) for lin in lins])) / 3)
        report(f"{name}: GEMV + add_rms_norm(split)",
               graph_us(lambda: none([add_rms_norm(resid, lin.matmul_prepared(xs), w, 1e-6, split=kind)
                                 for lin in lins])) / 3)
        report(f"{name}: GEMV residual-norm epilogue",
               graph_us(lambda: none([lin.matmul_residual_norm(xs, resid, w, 1e-6, split=kind) for lin in lins]
                       )) / 3)
        del lins
    gates = [(make_linear(args.fmt, F, E), make_linear(args.fmt, F, E)) for _ in range(2)]
    cats = [gemv.concat(list(p)) for p in gates]
    pairs = [gemv.glu_pair(*p) for p in gates]
    del gates
    xs = gemv.prepare(cp.random.standard_normal((1, E), dtype=cp.float32), kind)
    report("gate_up: GEMV", graph_us(lambda: none([c.matmul_prepared(xs) for c in cats])) / 2)
    report("gate_up: GEMV + silu_mul_rows(split)",
           graph_us(lambda: none([silu_mul_rows(c.matmul_prepared(xs), split=kind) for c in cats])) / 2)
    report("gate_up: glu epilogue", graph_us(lambda: none([p.matmul_prepared(xs, split=kind) for p in pairs])) / 2)
    del cats, pairs
    cp.get_default_memory_pool().free_all_blocks()
    # GDN decode, 27B: Hk 16, Hv 48, dk = dv = 128, K = 4
    hk, hv, d = 16, 48, 128
    c = 2 * hk * d + hv * d
    rnd = cp.random.standard_normal
    mixed, tail, conv = rnd((1, c), dtype=cp.float32), rnd((3, c), dtype=cp.float32), rnd((c, 4), dtype=cp.float32)
    a, b, z = rnd((1, hv), dtype=cp.float32), rnd((1, hv), dtype=cp.float32), rnd((1, hv * d), dtype=cp.float32)
    a_log, dt = cp.zeros(hv, cp.float32), cp.zeros(hv, cp.float32)
    state, nw = rnd((hv, d, d), dtype=cp.float32) * np.float32(0.01), cp.ones(d, cp.float32)
    report("gdn: prefill(T=1) + prepare (3 + 1 launches)",
           graph_us(lambda: none(gemv.prepare(gdn_prefill(mixed, tail, conv, a, b, a_log, dt, z, nw, state, hk, 1e-6),
                                         kind))))
    report("gdn: gdn_decode(split) (2 launches)",
           graph_us(lambda: none(gdn_decode(mixed, tail, conv, a, b, a_log, dt, z, nw, state, hk, 1e-6, split=kind)
                   )))
    # attention decode, 27B: H 24, Hkv 4, D 256, rotary 64
    h, hkv, dd = 24, 4, 256
    qg, kn, vn = rnd((h, 2 * dd), dtype=cp.float32), rnd((hkv, dd), dtype=cp.float32), rnd((hkv, dd), dtype=cp.float32)
    kc, vc = rnd((8192, hkv, dd), dtype=cp.float32), rnd((8192, hkv, dd), dtype=cp.float32)
    qn, kk, fr = cp.ones(dd, cp.float32), cp.ones(dd, cp.float32), cp.asarray(inv_freq(64, 1e7))
    for pos in (128, 4095):
        for fused in (False, True):
            report(f"attention pos {pos}: {'fused (1 launch)' if fused else 'partial + combine'}",
                   graph_us(lambda: none(attention_decode_step(qg, kn, vn, qn, kk, fr, kc, vc, pos, 1e-6, split=kind,
                                                          fused=fused))))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
