"""The tree-verify attention step alone (tandem/backend/cuda/attention_tree.py attention_tree_step: prep, partials,
combine) on Qwen3.5-27B's attention shape: 24 query heads, 4 KV heads, head dim 256, rotary 64. Random inputs on the
device; a random tree of N nodes (each hangs off one of the 3 before) after P cached rows. Reports the median of 20
event-timed calls (a kernel measurement; one attention layer of a verify).

python3 bench/tree_attention.py [--nodes 32] [--pos 128] [--label NAME]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import attention_tree as at  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    h, hkv, d, rd, start, n = 24, 4, 256, 64, args.pos, args.nodes
    rng = np.random.default_rng(0)
    parents = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1

    def dev(*shape: int) -> cp.ndarray:
        return cp.asarray(rng.standard_normal(shape).astype(np.float32))

    qg, k_new, v_new = dev(n, h, 2 * d), dev(n, hkv, d), dev(n, hkv, d)
    k_cache, v_cache = dev(start + n + 64, hkv, d), dev(start + n + 64, hkv, d)
    q_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    k_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    inv = cp.asarray(ad.inv_freq(rd, 1e7))
    dep, par = cp.asarray(depths, dtype=cp.int32), cp.asarray(parents, dtype=cp.int32)
    node_k, node_v = cp.empty((n, hkv, d), cp.float32), cp.empty((n, hkv, d), cp.float32)
    y = cp.empty((n, h * d), cp.float32)

    def run() -> None:
        at.attention_tree_step(qg, k_new, v_new, q_norm, k_norm, inv, k_cache, v_cache, start, dep, par, 1e-6,
                               node_k, node_v, out=y)

    for _ in range(5):
        run()
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(20):
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    print(f"{args.label + ': ' if args.label else ''}tree attention step, 27B shape, {n} nodes "
          f"(max depth {max(depths)}), P = {start}: median {sorted(times)[len(times) // 2]:.1f} us")


if __name__ == "__main__":
    main()
