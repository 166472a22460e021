"""Causal gated attention for a prefill chunk on tensor cores (kernel: cuda/attention_flash.cu ``flash_prefill<D>``).

`attention_flash_prefill`: T tokens at positions start..start+T-1 of a gated attention layer, after its projections.
attn_prep_rows (cuda/attention_tree.cu: q / k RMSNorm + RoPE, the K / V rows written to the cache in its dtype) and
then one flash-attention launch: 64 query rows of one head a block over the key tiles [64 j, 64 j + 64) of absolute
positions, bf16 operands on mma.sync with fp32 accumulators and an online softmax in base 2 (FlashAttention-2, Dao
2023, arXiv:2307.08691), output · σ(gate). Every key of a row comes from the cache, so rows restored from a cache
tier and rows this chunk wrote are read alike.

Exactness (docs/architecture.md, "Exactness"): a row's key tiles and their order depend on its position alone and
the MMA computes a row from its own operands, so a row's bits do not depend on T, on start, on the other rows or on
how a prompt was cut into chunks (tests/test_cuda_prefill.py). They are not decode's bits (decode reduces in fp32
on CUDA cores: attention_decode.py).

References: ``reference`` (the kernel's own operands: q, K and V rounded to bf16, then float64; the softmax weights'
bf16 rounding is what remains, ~3e-3 relative) and attention_tree.reference_prefill (the layer in float32 NumPy,
spec/qwen3_5.md §5; within ~1e-2 relative).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import f32, i32, kv_suffix, out_or_new
from tandem.backend.cuda.attention_decode import split_output
from tandem.backend.cuda.attention_args import attention_shapes as _shapes
from tandem.backend.cuda.attention_tree import _prep
from tandem.backend.cuda.loader import kernel, raise_smem_limit
from tandem.dtypes import bf16_to_f32, f32_to_bf16

KERNELS = ("flash_prefill##NAME",)
HEAD_DIMS = tuple(range(32, 257, 32))  # the head sizes cuda/attention_flash.cu instantiates
BLOCK_ROWS = 64  # query rows a block (FA_BM)
KEY_TILE = 64  # keys a tile, on absolute positions (FA_BN)
WARPS = 4
PAD = 8  # bf16 elements of padding a shared row (FA_PAD)
LOG2E = 1.4426950408889634


def smem_bytes(d: int) -> int:
    """Dynamic shared memory of a flash_prefill<d> block: Q, a K tile and a V tile of 64 rows, bf16, padded."""
    return 3 * BLOCK_ROWS * (d + PAD) * 2


def attention_flash_prefill(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any,
                            k_cache: Any, v_cache: Any, start: int, eps: float, out: Any = None, *,
                            split: str | None = None, xs: Any = None, mrope: Any = None) -> Any:
    """Prefill T tokens at positions start..start+T-1 of a gated attention layer on tensor cores.

    Args: qg [T, H, 2D] (q then gate per head), k_new / v_new [T, Hkv, D], q_norm / k_norm [D], inv_freq [rd/2]
    (float32, device); k_cache / v_cache [max_len, Hkv, D] float32 or uint16 (bf16 bits), rows start..start+T-1
    written; start ≥ 0; eps; out: optional [T, H·D] float32; split: None or a split kind (operand.SPLIT_CODE, e.g.
    "b16" for the o projection's prefill GEMM) written into xs [T, P, H·D] uint16 (allocated when None) instead of y;
    mrope: None (row t rotated at start + t), or a vision_mrope.MRopeRows of T rows (an image prompt's rows: each
    rotated at its 3-D position by vision_mrope.mrope_prep; the attention is the same, causal by sequence index).
    Returns: y [T, H·D] float32 = causal attention over rows [0, start + t] · σ(gate), or xs with ``split``.
    Raises: ValueError on bad shapes / dtypes, a head size not in HEAD_DIMS, or start + T beyond the cache."""
    t, h, hkv, d, _, max_len = _shapes(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache)
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d}: the flash prefill takes {HEAD_DIMS}")
    if not 0 <= start or start + t > max_len:
        raise ValueError(f"start {start} with {t} tokens outside the cache of {max_len} rows")
    kind, xs = split_output(split, xs, out, t, h * d)
    if mrope is not None:
        from tandem.backend.cuda.vision_mrope import mrope_prep

        q = mrope_prep(qg, k_new, v_new, q_norm, k_norm, inv_freq, mrope, k_cache, v_cache, start, eps)
    else:
        q = _prep(qg, k_new, v_new, q_norm, k_norm, inv_freq, None, k_cache, v_cache, start, start, eps)
    y = out_or_new("out", out, (t, h * d)) if kind == 0 else None
    fn = kernel("attention_flash", f"flash_prefill{d}" + kv_suffix(k_cache))
    nbytes = smem_bytes(d)
    raise_smem_limit(fn, nbytes)
    scale_log2 = float(np.float32(LOG2E / np.sqrt(d)))
    null = np.uint64(0)
    fn((-(-t // BLOCK_ROWS), h), (32 * WARPS,),
       (q, k_cache, v_cache, qg, y if y is not None else null, xs if xs is not None else null, i32(kind), i32(t),
        i32(h), i32(hkv), i32(start), f32(scale_log2)), shared_mem=nbytes)
    return y if kind == 0 else xs


def reference(q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, gate: np.ndarray, start: int) -> np.ndarray:
    """NumPy twin of flash_prefill: y [T, H·D] float32 for queries q [T, H, D] (normed, rotated) at positions
    start.. over key / value rows [start + T, Hkv, D] (float32 values as stored), gate [T, H, D]: causal softmax
    attention in float64 over q, K and V rounded to bf16 (the kernel's MMA operands), · σ(gate)."""
    t, h, d = q.shape
    hkv = k_rows.shape[1]
    g = h // hkv

    def b16(x: np.ndarray) -> np.ndarray:
        return bf16_to_f32(f32_to_bf16(np.asarray(x, dtype=np.float32))).astype(np.float64)

    qb, kb, vb = b16(q), b16(k_rows), b16(v_rows)
    out = np.empty((t, h, d), dtype=np.float64)
    for i in range(t):
        keys = start + i + 1
        for head in range(h):
            s = kb[:keys, head // g] @ qb[i, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, head] = (p @ vb[:keys, head // g]) / p.sum()
    sig = 1.0 / (1.0 + np.exp(-gate.astype(np.float64)))
    return (out * sig).reshape(t, h * d).astype(np.float32)
