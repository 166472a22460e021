"""Greedy token choice on the GPU: argmax over the vocabulary, so only ids cross to the host.

Kernel: cuda/argmax.cu. Reference: numpy.argmax along the last axis (first maximum; a NaN wins); exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel

KERNELS = ("argmax_partial", "argmax_final")
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


def reference(logits: np.ndarray) -> np.ndarray:
    """numpy.argmax over the last axis, int32."""
    ids: np.ndarray = np.argmax(logits, axis=-1).astype(np.int32)
    return ids
