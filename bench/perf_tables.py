"""docs/performance.md's long-context, prefill and invariant-cost table rows from the benchmarks' JSON files.

python3 bench/perf_tables.py [--contexts bench/results/cuda_decode_contexts_h200.json]
[--prefill-gemm bench/results/cuda_prefill_gemm_h200.json] — prints Markdown rows (no GPU needed): per shape and
format, decode ms (tok/s) and verify ms at each context with the bytes a step reads and the % of copy; prefill
tok/s (% of the tensor-core peak); per format and piece size the engine's GEMMs against the unconstrained ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _k(n: str) -> str:
    v = int(n)
    return f"{v // 1024}k" if v % 1024 == 0 else str(v)


def context_rows(res: dict[str, Any]) -> list[str]:
    """Rows: shape, format | decode ms (tok/s) at each context | verify ms | GB a step (KV %) | % of copy."""
    out = []
    for shape, s in res["shapes"].items():
        for fmt, f in s["formats"].items():
            cs = f["contexts"]
            verify_n = next(iter(next(iter(cs.values()))["verify_ms"]), "")
            dec = " / ".join(f"{c['decode_ms']:.2f} ({c['decode_tok_per_s']:.0f})" for c in cs.values())
            ver = " / ".join(f"{c['verify_ms'].get(verify_n, float('nan')):.2f}" for c in cs.values())
            gb = " / ".join(f"{c['bytes_per_step'] / 1e9:.1f} ({100 * c['kv_share']:.0f} %)" for c in cs.values())
            cp = " / ".join(f"{100 * c['fraction_of_copy']:.0f}" for c in cs.values())
            pre = " / ".join(f"{p['tok_per_s']:.0f} ({100 * p['fraction_of_peak']:.1f} %)"
                             for p in f.get("prefill", {}).values())
            out.append(f"| {shape.upper()} {fmt.upper()}, KV {'/'.join(f['kv_dtypes'])} | {dec} | {ver} ({verify_n} "
                       f"nodes) | {gb} | {cp} | {pre} |")
    heads = " / ".join(_k(c) for c in next(iter(next(iter(res["shapes"].values()))["formats"].values()))["contexts"])
    pre = " / ".join(_k(str(p)) for p in res.get("prefills", []))
    return [f"contexts {heads}; prefill {pre}; peak {res.get('peak_tflops')} TFLOPS; copy {res.get('copy_GBps')} GB/s",
            "| shape, format | decode ms (tok/s) | verify ms | GB a step (KV share) | % of copy | prefill tok/s "
            "(% of peak) |", "|---|---|---|---|---|---|", *out]


def gemm_rows(res: dict[str, Any]) -> list[str]:
    """Rows: format, piece rows | engine ms (% of peak) | each unconstrained form's ms (% of peak, cost)."""
    out = [f"peak {res['peak_tflops']} TFLOPS", "| format, rows a piece | engine (% of peak) | free32 (% of peak; "
           "the invariant's cost) | free64 (% of peak; cost) |", "|---|---|---|---|"]
    for fmt, f in res["formats"].items():
        for rows, m in f["model_piece"].items():
            e = m["engine"]
            free = " | ".join(f"{m[k]['ms']:.2f} ms ({100 * m[k]['fraction_of_peak']:.0f} %; "
                              f"{100 * m[k]['cost']:+.0f} %)" for k in ("free32", "free64") if k in m)
            out.append(f"| {fmt.upper()}, {rows} | {e['ms']:.2f} ms ({100 * e['fraction_of_peak']:.0f} %) | {free} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="bench/results/cuda_decode_contexts_h200.json")
    ap.add_argument("--prefill-gemm", default="bench/results/cuda_prefill_gemm_h200.json")
    args = ap.parse_args()
    for path, rows in ((args.contexts, context_rows), (args.prefill_gemm, gemm_rows)):
        if Path(path).exists():
            print(f"{path}:")
            print("\n".join(rows(json.loads(Path(path).read_text()))))
            print()


if __name__ == "__main__":
    main()
