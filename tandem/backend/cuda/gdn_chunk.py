"""The Gated DeltaNet recurrence of a prefill call in the chunked (WY) form on tensor cores: cuda/gdn_chunk.cu's
``gdn_chunk_prep<DK, SPLIT>`` (per 64-token chunk and v-head, in parallel: W, U, the intra-chunk products) then
``gdn_chunk_scan<DK, SPLIT>`` (the state through the chunks, 64 state columns a block). The tensor-core prefill's GDN
takes it with ``gdn_prefill.gdn_prefill_chunk(scan="chunked")``, between gdn_seq.cu's prep and gated-norm launches.

Math (per chunk and v-head, S the state at the chunk's start; Yang et al., arXiv 2412.06464 §3 and 2406.06484 §3):
G = cumsum(g), Γ = exp(G), A_ri = β_r exp(G_r - G_i) k_r·k_i (i < r), T = (I + A)^-1, W = T diag(βΓ) K,
U = T diag(β) V, P_ri = exp(G_r - G_i) q_r·k_i (i ≤ r); Δ = U - W S, O = diag(Γ) Q S + P Δ,
S' = Γ_63 S + (diag(exp(G_63 - G)) K)ᵀ Δ: the recurrent rule (gdn_seq.reference_prefill) in exact arithmetic.

Chunks sit on the absolute position grid: chunk c of a call starting at position ``start`` holds tokens
64c - start % 64 .. (zero rows, which are inert, pad the call's first and last chunk). A call from a grid position
therefore gives the same bits however its tokens were split at multiples of 64 (a chunk's arithmetic depends on its
tokens and the state alone); a split elsewhere rounds the cut chunk differently (deterministically). The prefix cache
keeps restore points on that grid (``Capabilities.prefill_grid``).

Precision: "3xtf32" (default) splits every mma operand into TF32 hi + lo (fp32-class error: the NumPy twin measures
~5e-7 relative on y and the state after 32k tokens against an fp64 recurrence); "tf32" rounds each operand to TF32
once (~5e-4 there, three times fewer mma instructions).

Reference: ``reference_scan`` / ``reference`` (the NumPy twin: the kernel's chunking, operand rounding and order of
products in fp32; it is checked against gdn_seq.reference_prefill on the CPU, the kernel against it on the GPU).
Tolerance of the kernel vs gdn_seq.reference_prefill: relative 1e-4 on y and the state ("3xtf32"), 3e-3 ("tf32").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.cuda import gdn_seq
from tandem.backend.cuda.arrays import i32
from tandem.backend.cuda.gdn_seq import GDNRows
from tandem.backend.cuda.loader import cupy, kernel, raise_smem_limit

KERNELS = ("gdn_chunk_prep##NAME", "gdn_chunk_scan##NAME")
CHUNK = 64  # tokens a chunk (GC_CHUNK), on the absolute position grid
COLS = 64  # state columns a scan block
KEY_HEAD_SIZES = (32, 64, 128)
PRECISIONS = {"3xtf32": 3, "tf32": 1}  # name -> SPLIT (mma instructions a product)
DEFAULT_PRECISION = "3xtf32"
PREP_THREADS, SCAN_THREADS = 128, 256
_LA = CHUNK + 4  # GC_LA
F32 = np.float32


class ChunkWorkspace(NamedTuple):
    """Device float32 buffers of ``gdn_chunk_prep``'s outputs for up to ``num_chunks`` chunks: w [chunks, Hv, 64,
    dk], u [chunks, Hv, 64, dv], p [chunks, Hv, 64, 64], gd [chunks, Hv, 2, 64] (Γ, then exp(G_63 - G))."""

    w: Any
    u: Any
    p: Any
    gd: Any
    num_chunks: int


def supports(dk: int, dv: int) -> bool:
    """Whether the kernels take this head shape: dk in KEY_HEAD_SIZES and dv a multiple of COLS."""
    return dk in KEY_HEAD_SIZES and dv > 0 and dv % COLS == 0


def check(dk: int, dv: int, start: int, precision: str) -> None:
    """Raises ValueError unless the kernels take this call: ``supports(dk, dv)``, start ≥ 0, a PRECISIONS key."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {sorted(PRECISIONS)}, got {precision!r}")
    if not supports(dk, dv):
        raise ValueError(f"the chunked scan takes dk in {KEY_HEAD_SIZES} and dv a multiple of {COLS}, got {dk}, {dv}")
    if start < 0:
        raise ValueError(f"start must be ≥ 0, got {start}")


def num_chunks(num_tokens: int, start: int) -> int:
    """Grid chunks a call of ``num_tokens`` tokens from position ``start`` touches."""
    return (start % CHUNK + num_tokens + CHUNK - 1) // CHUNK


def new_workspace(max_tokens: int, num_v_heads: int, dk: int, dv: int) -> ChunkWorkspace:
    """A workspace for any call of at most ``max_tokens`` tokens from any start (≈ 4 (dk + dv + 66) · Hv bytes a
    token: 82 KB at the 27B's 48 heads of 128)."""
    n = (max_tokens + 2 * CHUNK - 2) // CHUNK
    e = cupy().empty
    return ChunkWorkspace(e((n * num_v_heads * CHUNK * dk,), F32), e((n * num_v_heads * CHUNK * dv,), F32),
                          e((n * num_v_heads * CHUNK * CHUNK,), F32), e((n * num_v_heads * 2 * CHUNK,), F32), n)


def prep_smem_bytes(dk: int) -> int:
    """Dynamic shared memory of gdn_chunk_prep: sK, sX, sA, sT and three 64-float vectors."""
    return 4 * CHUNK * ((dk + 4) + (max(dk, CHUNK) + 4) + 2 * _LA + 3)


def scan_smem_bytes(dk: int) -> int:
    """Dynamic shared memory of gdn_chunk_scan (ScanSmem): W, Q, K, P, U, Δ, the state tile, Γ and dec."""
    return 4 * (3 * CHUNK * (dk + 4) + 3 * CHUNK * _LA + dk * _LA + 2 * CHUNK)


def gdn_chunk_scan(rows: GDNRows, state: Any, y: Any, start: int, tail: Any, mixed: Any, num_k_heads: int,
                   precision: str = DEFAULT_PRECISION, workspace: ChunkWorkspace | None = None) -> None:
    """The recurrence of T prepared tokens in the chunked form; two launches (prep, scan).

    Args:
        rows: `GDNRows` of T tokens (gdn_seq_prep's q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv]).
        state: [Hv, dk, dv] float32, updated in place. y: [T, Hv·dv] float32, the un-normed outputs.
        start: the absolute position of token 0 (only start % 64 matters: the chunk grid).
        tail: [K-1, C] float32 conv tail, set to the last K-1 rows of [tail; mixed]; mixed: [T, C] float32.
        num_k_heads: Hk. precision: a PRECISIONS key. workspace: ``new_workspace`` of ≥ T tokens (else allocated).
    Raises: ValueError on an unknown precision, a head shape ``supports`` refuses, a workspace too small, start < 0.
    Layout: all C-contiguous device arrays; the workspace as ``ChunkWorkspace``.
    """
    hv, dk, dv = (int(s) for s in state.shape)
    n = int(rows.q.shape[0])
    check(dk, dv, start, precision)
    chunks = num_chunks(n, start)
    ws = workspace if workspace is not None else new_workspace(n, hv, dk, dv)
    if ws.num_chunks < chunks or int(ws.w.size) < chunks * hv * CHUNK * dk or int(ws.u.size) < chunks * hv * CHUNK * dv:
        raise ValueError(f"workspace holds {ws.num_chunks} chunks of this shape; the call needs {chunks}")
    name = f"{dk}x{PRECISIONS[precision]}"
    lead = start % CHUNK
    prep = kernel("gdn_chunk", f"gdn_chunk_prep{name}")
    raise_smem_limit(prep, prep_smem_bytes(dk))
    prep((chunks, hv), (PREP_THREADS,),
         (rows.q, rows.k, rows.v, rows.g, rows.beta, ws.w, ws.u, ws.p, ws.gd, i32(n), i32(lead), i32(num_k_heads),
          i32(hv), i32(dv)), shared_mem=prep_smem_bytes(dk))
    scan = kernel("gdn_chunk", f"gdn_chunk_scan{name}")
    raise_smem_limit(scan, scan_smem_bytes(dk))
    scan((hv, dv // COLS), (SCAN_THREADS,),
         (rows.q, rows.k, ws.w, ws.u, ws.p, ws.gd, state, y, i32(n), i32(lead), i32(num_k_heads), i32(hv), i32(dv),
          tail, mixed, i32(int(tail.shape[0])), i32(int(mixed.shape[1]))), shared_mem=scan_smem_bytes(dk))


# ------------------------------------------------------------------------------------------ the NumPy twin
def tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest TF32 value (10 mantissa bits, ties away from zero: cvt.rna.tf32.f32), as float32."""
    bits = np.ascontiguousarray(x, F32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(F32)


def _mm(a: np.ndarray, b: np.ndarray, split: int) -> np.ndarray:
    """a @ b as the kernel's mma does it: operands rounded to TF32 (split 1) or split into TF32 hi + lo with
    lo·hi + hi·lo + hi·hi (split 3); fp32 products and sums."""
    ah, bh = tf32(a), tf32(b)
    if split == 1:
        return np.asarray(np.matmul(ah, bh), F32)
    al, bl = tf32(a - ah), tf32(b - bh)
    return np.asarray((np.matmul(al, bh) + np.matmul(ah, bl)) + np.matmul(ah, bh), F32)


def _chunk(x: np.ndarray, t0: int) -> np.ndarray:
    """Rows t0 .. t0 + 63 of x [T, Hv, ...] as [Hv, 64, ...], zeros outside [0, T)."""
    out = np.zeros((CHUNK,) + x.shape[1:], F32)
    lo, hi = max(t0, 0), min(t0 + CHUNK, x.shape[0])
    if hi > lo:
        out[lo - t0:hi - t0] = x[lo:hi]
    return np.moveaxis(out, 0, 1)


def _inverse(a: np.ndarray) -> np.ndarray:
    """(I + A)^-1 of strictly lower A [Hv, 64, 64] by forward substitution: row r = -Σ_{i<r} A[r][i] T[i]."""
    t = np.zeros_like(a)
    t[:, 0, 0] = 1.0
    for r in range(1, CHUNK):
        t[:, r, :r] = -np.einsum("hi,hij->hj", a[:, r, :r], t[:, :r, :r])
        t[:, r, r] = 1.0
    return t


def reference_scan(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                   beta: np.ndarray, start: int = 0, precision: str = DEFAULT_PRECISION) -> np.ndarray:
    """The NumPy twin of gdn_chunk_prep + gdn_chunk_scan: the kernel's chunks (on the grid of ``start``), operand
    rounding and products, in fp32 (its sums in NumPy's order, not the mma's).

    Args: state [Hv, dk, dv] float32, updated in place; q, k [T, Hv, dk] (L2-normed, q scaled, expanded to v-heads),
        v [T, Hv, dv], g, beta [T, Hv], float32, as for numpy_ops.gdn_step; start: position of token 0;
        precision: a PRECISIONS key.
    Returns: o [T, Hv, dv] float32, the un-normed outputs.
    Raises: ValueError on an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {sorted(PRECISIONS)}, got {precision!r}")
    split = PRECISIONS[precision]
    n = q.shape[0]
    out = np.empty(v.shape, F32)
    lower = np.tril(np.ones((CHUNK, CHUNK), bool))
    for c in range(num_chunks(n, start)):
        t0 = c * CHUNK - start % CHUNK
        qc, kc, vc, gc, bc = (_chunk(x, t0) for x in (q, k, v, g, beta))  # [Hv, 64, ...]
        gg = np.cumsum(gc, axis=1, dtype=F32)  # G
        gam = np.exp(gg).astype(F32)
        dec = np.exp(gg[:, -1:] - gg).astype(F32)
        diff = np.where(lower, gg[:, :, None] - gg[:, None, :], F32(0.0))
        m = np.where(lower, np.exp(diff), F32(0.0)).astype(F32)  # exp(G_r - G_i), i ≤ r
        kt = kc.transpose(0, 2, 1)
        a = np.tril(bc[:, :, None] * (m * _mm(kc, kt, split)), -1).astype(F32)
        p = (m * _mm(qc, kt, split)).astype(F32)
        t = _inverse(a)
        w = _mm(t, (bc * gam)[:, :, None] * kc, split)
        u = _mm(t, bc[:, :, None] * vc, split)
        d = u - _mm(w, state, split)
        o = gam[:, :, None] * _mm(qc, state, split) + _mm(p, d, split)
        state *= gam[:, -1][:, None, None]
        state += _mm((dec[:, :, None] * kc).transpose(0, 2, 1), d, split)
        lo, hi = max(t0, 0), min(t0 + CHUNK, n)
        out[lo:hi] = o.transpose(1, 0, 2)[lo - t0:hi - t0]
    return out


def reference(mixed: np.ndarray, tail: np.ndarray, conv_w: np.ndarray, a: np.ndarray, b: np.ndarray,
              a_log: np.ndarray, dt_bias: np.ndarray, z: np.ndarray, norm_w: np.ndarray, state: np.ndarray,
              num_k_heads: int, eps: float, start: int = 0, precision: str = DEFAULT_PRECISION) -> np.ndarray:
    """NumPy twin of a GDN layer over a prefill call with the chunked scan (tail and state updated in place):
    gdn_seq.reference_prefill's prep and gated norm around ``reference_scan``. Arguments as
    gdn_seq.reference_prefill, plus start and precision as ``reference_scan``; returns y [T, Hv·dv] float32."""
    hv, dk, dv = state.shape
    window = np.concatenate([tail, mixed])
    u = numpy_ops.causal_conv(window, conv_w)
    tail[...] = window[window.shape[0] - tail.shape[0]:]
    q, k, v = gdn_seq._qkv(u, num_k_heads, hv, dk, dv)
    g, beta = numpy_ops.gdn_gates(a, b, a_log, dt_bias)
    o = reference_scan(state, q, k, v, g, beta, start, precision)
    return numpy_ops.gated_rms_norm(o, z.reshape(o.shape), norm_w, eps).reshape(o.shape[0], -1)
