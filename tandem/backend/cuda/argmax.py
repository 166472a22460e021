"""Greedy token choice on the GPU: argmax over the vocabulary, so only ids cross to the host.

Kernel: cuda/argmax.cu. Reference: numpy.argmax along the last axis (first maximum; a NaN wins); exact.
``top_k``: a drafter's k best ids of each row with the softmax normaliser (cuda/argmax.cu top_k_*), so a draft step
reads 2 + 2k words, not the row; reference ``reference_top_k``.
(token_reader.py builds on these: an id chosen on the device and copied to the host asynchronously.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel

KERNELS = ("argmax_partial", "argmax_final", "top_k_partial", "top_k_final")
TOP_K_MAX = 4  # cuda/argmax.cu TOPK_MAX
THREADS = 256
MAX_PARTS = 128


def argmax(logits: Any, out: Any = None) -> Any:
    """ids[t] = argmax_j logits[t, j].

    Args: logits [T, V] float32 (device, contiguous), V ≥ 1.
    Returns: [T] int32 on the device. Raises: ValueError on a bad dtype / shape.
    """
    require("logits", logits, np.float32, (None, None))
    rows, vocab = (int(s) for s in logits.shape)
    if vocab < 1 or rows < 1:
        raise ValueError(f"logits: need T ≥ 1 and V ≥ 1, got {list(logits.shape)}")
    ids = out_or_new("out", out, (rows,), np.int32)
    parts = max(1, min(MAX_PARTS, -(-vocab // (THREADS * 8))))
    cp = cupy()
    part_val = cp.empty((rows, parts), dtype=cp.float32)
    part_idx = cp.empty((rows, parts), dtype=cp.int32)
    kernel("argmax", "argmax_partial")((parts, rows), (THREADS,), (logits, part_val, part_idx, i32(vocab)))
    kernel("argmax", "argmax_final")((rows,), (THREADS,), (part_val, part_idx, ids, i32(parts)))
    return ids


def top_k(logits: Any, k: int, out: Any = None) -> Any:
    """The k best ids of each row and the row's softmax normaliser, on the device.

    Args: logits [T, V] float32 (device, contiguous), V ≥ 1; 1 ≤ k ≤ TOP_K_MAX; out: optional [T, 2 + 2k] int32.
    Returns: out [T, 2 + 2k] int32 (device): per row the max of its non-NaN values (its value exact; the sign of a
    zero max may follow the reduction order) and the sum of exp(x - max) over the row (float32 bits; a NaN in the row
    makes the sum NaN, one +inf makes it 1, more +infs NaN), the k ids (larger logit first, ties to the smaller id, a
    NaN first; past V, 0x7FFFFFFF with -inf), then their logits (float32 bits). ``unpack_top_k`` reads a host copy.
    Launches: 2.
    Raises: ValueError on a bad dtype / shape or k.
    """
    require("logits", logits, np.float32, (None, None))
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [T, V], got {list(logits.shape)}")
    rows, vocab = (int(s) for s in logits.shape)
    if vocab < 1 or rows < 1:
        raise ValueError(f"logits: need T ≥ 1 and V ≥ 1, got {list(logits.shape)}")
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= TOP_K_MAX:
        raise ValueError(f"k must be in 1..{TOP_K_MAX}, got {k}")
    res = out_or_new("out", out, (rows, 2 + 2 * k), np.int32)
    parts = max(1, min(MAX_PARTS, -(-vocab // (THREADS * 8))))
    cp = cupy()
    part_val = cp.empty((rows, parts, k), dtype=cp.float32)
    part_idx = cp.empty((rows, parts, k), dtype=cp.int32)
    part_lse = cp.empty((rows, parts, 2), dtype=cp.float32)
    kernel("argmax", "top_k_partial")((parts, rows), (THREADS,), (logits, part_val, part_idx, part_lse, i32(vocab),
                                                                   i32(k)))
    kernel("argmax", "top_k_final")((rows,), (THREADS,), (part_val, part_idx, part_lse, res, i32(parts), i32(k)))
    return res


def unpack_top_k(packed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A host copy of ``top_k``'s result [T, 2 + 2k] int32 -> (ids [T, k] int32, probabilities [T, k] float64 =
    exp(logit - max) / sum: the whole row's softmax at those ids (0 for a missing id past V, NaN in a row with a
    NaN), logits [T, k] float32)."""
    packed = np.ascontiguousarray(packed, dtype=np.int32)
    floats = packed.view(np.float32)
    mx, total = floats[:, :1].astype(np.float64), floats[:, 1:2].astype(np.float64)
    ids, vals = packed[:, 2:2 + k].copy(), floats[:, 2 + k:2 + 2 * k].copy()
    with np.errstate(invalid="ignore", over="ignore"):
        probs = np.exp(vals.astype(np.float64) - mx) / total
    probs[ids == 0x7FFFFFFF] = 0.0
    return ids, probs, vals


def reference_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """NumPy twin of ``top_k`` (the same packing; the sum in float64, so it equals the kernel's to rounding)."""
    rows, vocab = logits.shape
    out = np.zeros((rows, 2 + 2 * k), dtype=np.int32)
    fl = out.view(np.float32)
    for t in range(rows):
        x = np.asarray(logits[t], dtype=np.float32)
        nan = np.isnan(x)
        order = np.lexsort((np.arange(vocab), -np.where(nan, 0, x), ~nan))[:k]  # NaN first, larger, smaller id
        real = x[~nan & ~np.isneginf(x)]
        mx = float(real.max()) if real.size else -np.inf
        if nan.any():
            total = np.nan
        elif np.isposinf(mx):  # the kernel's running sum: one +inf counts 1, a second one makes it NaN
            total = 1.0 if int(np.isposinf(real).sum()) == 1 else np.nan
        else:
            total = np.exp(real.astype(np.float64) - mx).sum() if real.size else 0.0
        fl[t, 0], fl[t, 1] = np.float32(mx), np.float32(total)
        out[t, 2:2 + k] = 0x7FFFFFFF
        fl[t, 2 + k:2 + 2 * k] = -np.inf
        out[t, 2:2 + len(order)] = order
        fl[t, 2 + k:2 + k + len(order)] = x[order]
    return out


def reference(logits: np.ndarray) -> np.ndarray:
    """numpy.argmax over the last axis, int32."""
    ids: np.ndarray = np.argmax(logits, axis=-1).astype(np.int32)
    return ids
