"""A Gated DeltaNet layer over a prefill chunk on the GPU, after its projections: the tensor-core prefill's GDN
(tandem/models/qwen3_5/cuda_prefill.py). Kernels: cuda/gdn_prefill.cu ``gdn_prefill_scan<DK, ROWS>``, with
cuda/gdn_seq.cu's gdn_seq_prep (causal conv + SiLU, L2 norms, gates) before it and gdn_seq_norm (gated RMSNorm)
after it, as gdn_seq.gdn_prefill runs them.

The scan spreads each state column over DK / ROWS lanes (many more warps than gdn_seq.cu's scan, which keeps
decode's bits): the recurrence in its own fixed order (the kernel's comment), so a chunk's bits depend on the
state and the chunk's tokens alone, not on where a prompt was cut into chunks (docs/architecture.md, "Exactness").
ROWS (state rows a lane) is chosen per key head size by ``DEFAULT_ROWS`` (bench/prefill.py measures the others).

``scan="chunked"`` runs the recurrence in the chunked (WY) form on tensor cores instead (tandem/backend/cuda/
gdn_chunk.py, cuda/gdn_chunk.cu): chunks of 64 tokens on the absolute position grid, so a call is invariant to splits
at multiples of 64 only (``Capabilities.prefill_grid``); its reference and tolerances are gdn_chunk's.

Reference: gdn_seq.reference_prefill (NumPy, the recurrent form token by token, spec/qwen3_5.md §4). Tolerance:
relative 1e-4 on y and the state (fp32 in another summation order); the tail bitwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda import gdn_chunk, gdn_seq
from tandem.backend.cuda.arrays import i32, out_or_new
from tandem.backend.cuda.gdn_seq import GDNRows, new_rows
from tandem.backend.cuda.loader import kernel

KERNELS = ("gdn_prefill_scan##NAME",)
SCANS = ("recurrent", "chunked")  # the per-token scan (this file's kernel) or gdn_chunk's WY form
VARIANTS = {32: (8,), 64: (8, 16), 128: (8, 16, 32), 256: (16, 32)}  # dk -> state rows a lane (cuda/gdn_prefill.cu)
DEFAULT_ROWS = {32: 8, 64: 8, 128: 16, 256: 16}
WARPS = 4  # GP_WARPS


def columns_a_block(dk: int, rows: int) -> int:
    """State columns a scan block holds: 4 warps · 32 / (dk / rows)."""
    return WARPS * 32 // (dk // rows)


def gdn_prefill_chunk(mixed: Any, tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any,
                      norm_w: Any, state: Any, num_k_heads: int, eps: float, out: Any = None,
                      rows: GDNRows | None = None, split: str | None = None, xs: Any = None,
                      rows_per_lane: int | None = None, scan: str = "recurrent", start: int = 0,
                      precision: str = gdn_chunk.DEFAULT_PRECISION,
                      workspace: gdn_chunk.ChunkWorkspace | None = None) -> Any:
    """T consecutive tokens of a GDN layer (a prefill chunk); three launches (prep, scan, norm), four with the
    chunked scan.

    Args as gdn_seq.gdn_prefill (mixed [T, C], tail [K-1, C], conv_w [C, K], a, b [T, Hv], a_log, dt_bias [Hv],
    z [T, Hv·dv], norm_w [dv], state [Hv, dk, dv] updated in place, all float32 on the device; out, rows, split,
    xs), and rows_per_lane: the recurrent scan's variant (VARIANTS[dk]; default DEFAULT_ROWS[dk]); scan: one of
    SCANS; for "chunked": start (the absolute position of token 0: the chunk grid), precision and workspace
    (gdn_chunk.gdn_chunk_scan's).
    Returns: y [T, Hv·dv] float32, or xs with ``split``.
    Raises: ValueError on bad shapes / dtypes (gdn_seq's checks), an unknown scan, a variant not in VARIANTS, dv not
    a multiple of a block's columns, or what gdn_chunk.gdn_chunk_scan raises."""
    dims = gdn_seq._check_layer(mixed, tail, conv_w, a, b, a_log, dt_bias, z, norm_w, state, num_k_heads)
    n, hv, dk, dv, _ = dims
    if scan not in SCANS:
        raise ValueError(f"scan: expected one of {SCANS}, got {scan!r}")
    r = cb = 0
    if scan == "recurrent":
        r = DEFAULT_ROWS[dk] if rows_per_lane is None else int(rows_per_lane)
        if r not in VARIANTS[dk]:
            raise ValueError(f"rows_per_lane {r}: dk {dk} takes {VARIANTS[dk]}")
        cb = columns_a_block(dk, r)
        if dv % cb:
            raise ValueError(f"dv {dv} must be a multiple of {cb} (a scan block's columns)")
    else:
        gdn_chunk.check(dk, dv, start, precision)
    rows = rows if rows is not None else new_rows(n, num_k_heads, hv, dk, dv)
    gdn_seq._check_rows(rows, n, num_k_heads, hv, dk, dv)
    y = out_or_new("out", out, (n, hv * dv))
    kind, xs = gdn_seq._split_out(split, xs, n, hv * dv)
    gdn_seq._prep(mixed, gdn_seq.NULL, tail, conv_w, a, b, a_log, dt_bias, rows, num_k_heads, dims)
    if scan == "chunked":
        gdn_chunk.gdn_chunk_scan(rows, state, y, start, tail, mixed, num_k_heads, precision, workspace)
    else:
        kernel("gdn_prefill", f"gdn_prefill_scan{dk}r{r}")(
            (hv, dv // cb), (32 * WARPS,),
            (rows.q, rows.k, rows.v, rows.g, rows.beta, state, y, i32(n), i32(num_k_heads), i32(hv), i32(dv), tail,
             mixed, i32(int(tail.shape[0])), i32(int(mixed.shape[1]))))
    gdn_seq._norm(y, z, norm_w, n, hv, dv, eps, kind, xs)
    return y if split is None else xs


def reference(mixed: np.ndarray, tail: np.ndarray, conv_w: np.ndarray, a: np.ndarray, b: np.ndarray,
              a_log: np.ndarray, dt_bias: np.ndarray, z: np.ndarray, norm_w: np.ndarray, state: np.ndarray,
              num_k_heads: int, eps: float) -> np.ndarray:
    """NumPy twin: gdn_seq.reference_prefill (tail and state updated in place); returns y [T, Hv·dv]."""
    return gdn_seq.reference_prefill(mixed, tail, conv_w, a, b, a_log, dt_bias, z, norm_w, state, num_k_heads, eps)
