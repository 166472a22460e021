"""Fused RMSNorm (+ residual add) on the GPU. Kernel: cuda/rms_norm.cu.

Reference: `reference` = numpy_ops.rms_norm (weight already 1 + w); `reference_add` = the residual update
followed by it. fp32 with a different summation order: relative error ≤ 1e-5. Row-invariant (block per row).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.loader import kernel

KERNELS = ("rms_norm", "add_rms_norm")
THREADS = 256


def rms_norm(x: Any, weight: Any, eps: float, out: Any = None) -> Any:
    """y = x · rsqrt(mean(x², -1) + eps) · weight over the last axis.

    Args: x [..., E] float32 (device, contiguous); weight [E] float32; eps.
    Returns: [..., E] float32. Raises: ValueError on a bad dtype / shape.
    """
    cols = int(x.shape[-1]) if x.ndim else 0
    require("x", x, np.float32, tuple(x.shape) if x.ndim else (None,))
    require("weight", weight, np.float32, (cols,))
    y = out_or_new("out", out, tuple(x.shape))
    rows = x.size // max(cols, 1)
    if rows:
        kernel("rms_norm", "rms_norm")((rows,), (THREADS,), (x, weight, y, i32(cols), f32(eps)))
    return y


def add_rms_norm(x: Any, delta: Any, weight: Any, eps: float, out: Any = None) -> Any:
    """x += delta (in place: the fp32 residual stream), then return rms_norm(x).

    Args: x, delta [..., E] float32 (device, same shape); weight [E] float32.
    Returns: [..., E] float32. Raises: ValueError on a bad dtype / shape.
    """
    cols = int(x.shape[-1]) if x.ndim else 0
    require("x", x, np.float32, tuple(x.shape) if x.ndim else (None,))
    require("delta", delta, np.float32, tuple(x.shape))
    require("weight", weight, np.float32, (cols,))
    y = out_or_new("out", out, tuple(x.shape))
    rows = x.size // max(cols, 1)
    if rows:
        kernel("rms_norm", "add_rms_norm")((rows,), (THREADS,), (x, delta, weight, y, i32(cols), f32(eps)))
    return y


def reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """numpy_ops.rms_norm."""
    return numpy_ops.rms_norm(x, weight, eps)


def reference_add(x: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x + delta, rms_norm(x + delta)): the updated residual and the normed row."""
    s = (x + delta).astype(np.float32)
    return s, numpy_ops.rms_norm(s, weight, eps)
