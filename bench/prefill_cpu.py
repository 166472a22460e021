"""CPU prefill benchmark: the model's one-pass prefill against the engine's chunked prefill with the prefix cache
off, on (snapshots taken on the grid: their cost on a cold request) and restored (a resend, and a resend plus
``--extra`` new tokens).

    python bench/prefill_cpu.py [--model PATH] [--tokens 1772] [--chunk 256] [--runs 3]
        [--json bench/results/prefill_cpu.json]

Times are the best of ``--runs`` (the machine may be shared); TTFT is from the call to the first chunk. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.cache.store import GB, PrefixCache  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft(engine: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    for _ in engine.generate(ids, ONE):
        return time.perf_counter() - t0
    raise RuntimeError("no chunk")


def best_us(fn: Any, repeats: int = 200) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[repeats // 10] * 1e6


def row_invariance_probe(model: Any) -> dict[str, Any]:
    """The BLAS facts behind the one-GEMV-a-row Linear (tandem/formats/linear.py): whether a GEMM row's bits depend on
    the row count (M = 1 is forwarded to GEMV), and the price of an M = 2 GEMM against the GEMV on the head
    ([V, E], which keeps its GEMV); the recurrent delta rule that prefill now runs against the chunked one (64
    tokens, one GDN layer of the model's shape)."""
    from tandem.backend import numpy_ops as ops

    rng = np.random.default_rng(1)
    w = np.ascontiguousarray(model.head.weight)
    x = rng.standard_normal((64, w.shape[1]), dtype=np.float32)
    full = x @ w.T
    out = np.empty(w.shape[0], np.float32)
    hp = model.hp
    hv, dk, dv = hp.linear_num_value_heads, hp.linear_key_head_dim, hp.linear_value_head_dim
    q = (rng.standard_normal((64, hv, dk)) * 0.1).astype(np.float32)
    v = rng.standard_normal((64, hv, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((64, hv))) * 0.1).astype(np.float32)
    beta = np.full((64, hv), 0.5, np.float32)

    def chunked() -> None:
        ops.gdn_chunk(np.zeros((hv, dk, dv), np.float32), q, q, v, g, beta)

    def recurrent() -> None:
        s = np.zeros((hv, dk, dv), np.float32)
        for t in range(64):
            ops.gdn_step(s, q[t], q[t], v[t], g[t], beta[t])

    return {"gemm_row_m1_equals_m64": bool(np.array_equal((x[5:6] @ w.T)[0], full[5])),
            "gemm_row_m2_equals_m64": bool(np.array_equal((x[5:7] @ w.T)[0], full[5])),
            "gemv_equals_gemm_row": bool(np.array_equal(w @ x[5], full[5])),
            "head_gemv_us": best_us(lambda: np.dot(w, x[5], out=out)),
            "head_gemm_m2_us": best_us(lambda: x[5:7] @ w.T),
            "gdn_chunked_64_tokens_ms": best_us(chunked, 20) / 1e3,
            "gdn_recurrent_64_tokens_ms": best_us(recurrent, 20) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1772)
    ap.add_argument("--extra", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = Engine.from_pretrained(args.model, cache="off", prefix_chunk=args.chunk)
    model = base.model
    ids = np.random.default_rng(0).integers(0, base.vocab_size, args.tokens + args.extra).tolist()
    prompt, longer = ids[:args.tokens], ids

    def best(fn: Any) -> float:
        return min(fn() for _ in range(args.runs))

    def one_pass() -> float:
        state = model.new_state(args.tokens)
        t0 = time.perf_counter()
        model.prefill(state, prompt)
        return time.perf_counter() - t0

    def cold_on() -> float:
        engine = Engine(model, None, None, None, (), "m", "off", PrefixCache(args.chunk, 2 * GB), args.chunk)
        return ttft(engine, prompt)

    warm = Engine(model, None, None, None, (), "m", "off", PrefixCache(args.chunk, 2 * GB), args.chunk)
    ttft(warm, prompt)
    out = {
        "model": base.name, "tokens": args.tokens, "prefix_chunk": args.chunk, "runs": args.runs,
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average_1m_at_start": os.getloadavg()[0],
        "model_prefill_one_pass_s": best(one_pass),
        "engine_cache_off_ttft_s": best(lambda: ttft(base, prompt)),
        "engine_cache_on_cold_ttft_s": best(cold_on),
        "engine_resend_ttft_s": best(lambda: ttft(warm, prompt)),
        f"engine_resend_plus_{args.extra}_ttft_s": best(lambda: ttft(warm, longer)),
    }
    out["row_invariance_probe"] = row_invariance_probe(model)
    out["prefill_tokens_per_s"] = args.tokens / out["model_prefill_one_pass_s"]
    out["snapshot_overhead_fraction"] = out["engine_cache_on_cold_ttft_s"] / out["engine_cache_off_ttft_s"] - 1
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
