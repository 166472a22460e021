"""Attention at depth: one layer's decode step and 16-node tree verify on Qwen3.5-27B's attention shape (24 query
heads, 4 KV heads, head dim 256, rotary 64) at contexts 1k to 128k, the KV cache in fp32 and in bf16.

The launches the engine's plans make (attention_decode.DecodeStep, attention_tree.TreeStep: prebuilt argument blocks)
on random caches; device time per call is the median over 5 replays of a CUDA graph of 20 calls (a measurement aid,
the engine does not use graphs), so host launch time is left out. Reports per (storage, context) the decode and
verify µs, the KV bytes a decode reads (K and V rows 0..pos) and that as GB/s and as a fraction of the device-to-device
copy bandwidth measured in the same run (bytes read + written per second, bench/decode.py's measure), and the
decode time a 27B model would add over its 1k figure: 16 attention layers × (this context's µs - 1k's).

python3 bench/attention_context.py [--kv fp32,bf16] [--contexts 1024,8192,32768,131072] [--split-decode CHUNKS]
[--attention cuda_cores,tensor_cores] [--repo PATH] [--out F.json]
(--repo: the checkout whose tandem package to time, default this file's; a tree without bf16 KV is timed in fp32)
--attention: the decode / verify attention paths to time on each storage, one after the other on the same caches in
one run: cuda_cores (attn_partial / tree_partial, the default) and tensor_cores (attention_tc.py, bf16 KV only:
attention_tc.TcDecodeStep / TcTreeStep). The verify's GB/s is over the same KV bytes (rows 0..P, the
nodes' rows left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", default="fp32,bf16")
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--label", default="")
    ap.add_argument("--split-decode", type=int, default=None,
                    help="attention_decode.SPLIT_DECODE_MIN_CHUNKS for this run (default: the module's)")
    ap.add_argument("--attention", default="cuda_cores",
                    help="comma-separated: cuda_cores, tensor_cores (bf16 KV only)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sys.path.insert(0, args.repo)
    import cupy as cp
    import numpy as np

    from tandem.backend.cuda import attention_decode as ad
    from tandem.backend.cuda import attention_tree as at

    if args.split_decode is not None:
        ad.SPLIT_DECODE_MIN_CHUNKS = args.split_decode
    h, hkv, d, rd, n = 24, 4, 256, 64, args.nodes
    rng = np.random.default_rng(0)

    def graph_us(fn: Callable[[], None], calls: int = 20) -> float:
        for _ in range(3):
            fn()
        cp.cuda.Device().synchronize()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            for _ in range(calls):
                fn()
            graph = stream.end_capture()
        times = []
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / calls)
        return float(statistics.median(times))

    n_copy = 2 << 30
    src = cp.random.randint(0, 256, n_copy, dtype=cp.uint8)
    dst = cp.empty_like(src)
    copy_us = graph_us(lambda: cp.copyto(dst, src), 5)
    copy_gbps = 2 * n_copy / copy_us / 1e3
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()

    parents = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1

    def dev(*shape: int) -> Any:
        return cp.asarray(rng.standard_normal(shape).astype(np.float32))

    qg, k_new, v_new = dev(1, h, 2 * d), dev(1, hkv, d), dev(1, hkv, d)
    tqg, tk, tv = dev(n, h, 2 * d), dev(n, hkv, d), dev(n, hkv, d)
    q_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    k_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    inv = cp.asarray(ad.inv_freq(rd, 1e7))
    dep, par = cp.asarray(depths, dtype=cp.int32), cp.asarray(parents, dtype=cp.int32)
    result: dict[str, Any] = {"command": "python3 bench/attention_context.py " + " ".join(sys.argv[1:]),
                              "label": args.label, "copy_GBps": round(copy_gbps, 1), "nodes": n, "runs": []}
    print(f"{args.label + ': ' if args.label else ''}copy {copy_gbps:.0f} GB/s (read + written)")
    contexts = [int(c) for c in args.contexts.split(",")]
    for kv in args.kv.split(","):
        dtype = cp.float32 if kv == "fp32" else cp.uint16
        base: dict[str, dict[str, float]] = {}
        for ctx in contexts:
            rows = ctx + 128
            if dtype == cp.float32:
                kc, vc = dev(rows, hkv, d), dev(rows, hkv, d)
            else:
                kc = cp.random.randint(0x3C00, 0x4000, (rows, hkv, d), dtype=cp.uint16)  # bf16 in [2^-7, 2)
                vc = cp.random.randint(0xBC00, 0xC000, (rows, hkv, d), dtype=cp.uint16) ^ cp.uint16(0x8000)
            for path in args.attention.split(","):
                if path == "tensor_cores" and kv != "bf16":
                    continue  # the tensor-core path reads bf16 rows only
                try:
                    node_k, node_v = cp.empty((n, hkv, d), dtype), cp.empty((n, hkv, d), dtype)
                    if path == "tensor_cores":
                        from tandem.backend.cuda import attention_tc as tc

                        step: Any = tc.TcDecodeStep(qg[0], k_new[0], v_new[0], q_norm, k_norm, inv, kc, vc, 1e-6)
                        tree: Any = tc.TcTreeStep(tqg, tk, tv, q_norm, k_norm, inv, kc, vc, dep, par, 1e-6, node_k,
                                                  node_v)
                    else:
                        step = ad.DecodeStep(qg[0], k_new[0], v_new[0], q_norm, k_norm, inv, kc, vc, 1e-6)
                        tree = at.TreeStep(tqg, tk, tv, q_norm, k_norm, inv, kc, vc, dep, par, 1e-6, node_k, node_v)
                except (ValueError, ImportError) as e:  # a tree without this storage or path
                    print(f"{kv} {path}: not supported here ({e})")
                    continue
                dec_us = graph_us(lambda: step(ctx))
                tree_us = graph_us(lambda: tree(ctx))
                kv_bytes = 2 * (ctx + 1) * hkv * d * int(kc.itemsize)
                gbps = kv_bytes / dec_us / 1e3
                first = base.setdefault(path, {"decode_us": dec_us, "verify_us": tree_us})
                run = {"kv": kv, "attention": path, "context": ctx, "decode_us": round(dec_us, 2),
                       "verify16_us": round(tree_us, 2), "kv_bytes": kv_bytes, "decode_GBps": round(gbps, 1),
                       "decode_fraction_of_copy": round(gbps / copy_gbps, 3),
                       "verify_GBps": round(kv_bytes / tree_us / 1e3, 1),
                       "verify_fraction_of_copy": round(kv_bytes / tree_us / 1e3 / copy_gbps, 3),
                       "decode_over_first_context": round(dec_us / first["decode_us"], 3),
                       "verify_over_first_context": round(tree_us / first["verify_us"], 3),
                       "27b_decode_ms_added_over_first_context": round(16 * (dec_us - first["decode_us"]) / 1e3, 3)}
                result["runs"].append(run)
                print(f"{kv} {path:12s} ctx {ctx:6d}: decode {dec_us:8.1f} us ({gbps:6.0f} GB/s, "
                      f"{100 * gbps / copy_gbps:3.0f}% of copy, {run['decode_over_first_context']}x)  verify{n} "
                      f"{tree_us:8.1f} us ({run['verify_over_first_context']}x the first context)  "
                      f"27B decode +{run['27b_decode_ms_added_over_first_context']} ms over ctx {contexts[0]}",
                      flush=True)
                del step, tree
            del kc, vc
            cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
