"""The prefill attention step alone (tandem/backend/cuda/attention_tree.py attention_prefill_step: prep, partials,
combine) on Qwen3.5-27B's attention shape (24 query heads, 4 KV heads, head dim 256, rotary 64): the exact kernel
(prefill_partial, decode's bits) against the unconstrained fp32 flash kernel (prefill_attn, exact=False), for a
prompt of P tokens prefilled in the engine's 64-token pieces (piece i at start 64 i over the rows before it). One
attention layer; random inputs on the device; event-timed; the median of --repeat passes over the whole prompt.

Reports per kernel: the whole prompt's attention time (ms), its rate (TFLOP/s, counting 4 · D · H FLOPs a (query,
key) pair: q·k and the V sum), the last piece's time (its context P - 64), and exact / flash. Also the largest
relative difference between the two outputs of the last piece (a sanity figure: the flash kernel is within 1e-4).

python3 bench/prefill_attention.py [--prompt 4096 32768] [--repeat 3] [--json PATH]
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

from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import attention_tree as at  # noqa: E402

H, HKV, D, RD, PIECE = 24, 4, 256, 64, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    variants = [("exact", True), ("flash", False)]
    rng = np.random.default_rng(0)

    def dev(*shape: int, scale: float = 1.0) -> Any:
        return cp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))

    results = []
    for prompt in args.prompt:
        k_cache, v_cache = dev(prompt, HKV, D), dev(prompt, HKV, D)
        qg, k_new, v_new = dev(PIECE, H, 2 * D), dev(PIECE, HKV, D), dev(PIECE, HKV, D)
        q_norm, k_norm = 1 + dev(D, scale=0.1), 1 + dev(D, scale=0.1)
        inv = cp.asarray(ad.inv_freq(RD, 1e7))
        y = cp.empty((PIECE, H * D), cp.float32)
        outs: dict[str, Any] = {}

        def run(exact: bool, starts: range) -> float:
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for s in starts:
                at.attention_prefill_step(qg, k_new, v_new, q_norm, k_norm, inv, k_cache, v_cache, s, 1e-6, out=y,
                                          exact=exact)
            e1.record()
            e1.synchronize()
            return float(cp.cuda.get_elapsed_time(e0, e1))

        row: dict[str, Any] = {"prompt": prompt}
        pairs = sum(t + 1 for t in range(prompt))
        last = range(prompt - PIECE, prompt, PIECE)
        for name, exact in variants:
            run(exact, last)  # compile, warm
            whole = sorted(run(exact, range(0, prompt, PIECE)) for _ in range(args.repeat))
            tail = sorted(run(exact, last) for _ in range(5 * args.repeat))
            outs[name] = cp.asnumpy(y)
            ms = whole[len(whole) // 2]
            row[name] = {"prompt_ms": ms, "prompt_ms_all": whole, "tflops": 4 * D * H * pairs / ms / 1e9,
                         "last_piece_ms": tail[len(tail) // 2]}
        diff = float(np.max(np.abs(outs["exact"] - outs["flash"])) / np.max(np.abs(outs["flash"])))
        row["exact_over_flash"] = row["exact"]["prompt_ms"] / row["flash"]["prompt_ms"]
        row["last_piece_exact_over_flash"] = row["exact"]["last_piece_ms"] / row["flash"]["last_piece_ms"]
        row["max_rel_diff_last_piece"] = diff
        results.append(row)
        print(f"P = {prompt}: exact {row['exact']['prompt_ms']:.1f} ms ({row['exact']['tflops']:.1f} TFLOP/s), "
              f"flash {row['flash']['prompt_ms']:.1f} ms ({row['flash']['tflops']:.1f} TFLOP/s), "
              f"exact / flash {row['exact_over_flash']:.3f}; last piece {row['exact']['last_piece_ms']:.3f} vs "
              f"{row['flash']['last_piece_ms']:.3f} ms; max rel diff {diff:.2e}", flush=True)
        del k_cache, v_cache
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        meta = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "shape": [H, HKV, D, RD],
                "piece": PIECE, "command": "python3 bench/prefill_attention.py " + " ".join(sys.argv[1:])}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
