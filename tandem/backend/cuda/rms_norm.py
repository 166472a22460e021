"""Fused RMSNorm (+ residual add) on the GPU. Kernel: cuda/rms_norm.cu.

Reference: `reference` = numpy_ops.rms_norm (weight already 1 + w); `reference_add` = the residual update
followed by it. fp32 with a different summation order: relative error ≤ 1e-5. Row-invariant (block per row).
With ``split`` (a gemv.PREP_KIND: "f16", "f16p", "bf16") the result is written as the next GEMV's operand xs
[rows, P, E] (tandem.backend.cuda.gemv.prepare's layout) instead of fp32: one launch instead of two.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.operand import SPLIT_CODE, split_operand
from tandem.backend.cuda.loader import kernel

KERNELS = ("rms_norm", "add_rms_norm")
THREADS = 256  # common.cuh NORM_THREADS: the reduction order the GEMV residual-norm epilogue shares


def _outputs(shape: tuple[int, ...], out: Any, split: str | None) -> tuple[Any, Any, Any]:
    """(y or None, xs or None, the value to return) for an fp32 or split result."""
    if split is None:
        y = out_or_new("out", out, shape)
        return y, None, y
    rows = 1
    for n in shape[:-1]:
        rows *= int(n)
    xs = split_operand(split, out, rows, int(shape[-1]))
    return None, xs, xs


def rms_norm(x: Any, weight: Any, eps: float, out: Any = None, split: str | None = None) -> Any:
    """y = x · rsqrt(mean(x², -1) + eps) · weight over the last axis.

    Args: x [..., E] float32 (device, contiguous); weight [E] float32; eps; split: None or a GEMV operand kind.
    Returns: [..., E] float32, or xs [rows, P, E] uint16 with ``split``. Raises: ValueError on a bad dtype / shape.
    """
    cols = int(x.shape[-1]) if x.ndim else 0
    require("x", x, np.float32, tuple(x.shape) if x.ndim else (None,))
    require("weight", weight, np.float32, (cols,))
    y, xs, result = _outputs(tuple(x.shape), out, split)
    rows = x.size // max(cols, 1)
    if rows:
        kernel("rms_norm", "rms_norm")((rows,), (THREADS,), (x, weight, y, xs, i32(SPLIT_CODE[split]), i32(cols),
                                                            f32(eps)))
    return result


def add_rms_norm(x: Any, delta: Any, weight: Any, eps: float, out: Any = None, split: str | None = None) -> Any:
    """x += delta (in place: the fp32 residual stream), then return rms_norm(x) (or its split operand).

    Args: x, delta [..., E] float32 (device, same shape); weight [E] float32; split: None or a GEMV operand kind.
    Returns: [..., E] float32, or xs [rows, P, E] uint16 with ``split``. Raises: ValueError on a bad dtype / shape.
    """
    cols = int(x.shape[-1]) if x.ndim else 0
    require("x", x, np.float32, tuple(x.shape) if x.ndim else (None,))
    require("delta", delta, np.float32, tuple(x.shape))
    require("weight", weight, np.float32, (cols,))
    y, xs, result = _outputs(tuple(x.shape), out, split)
    rows = x.size // max(cols, 1)
    if rows:
        kernel("rms_norm", "add_rms_norm")((rows,), (THREADS,), (x, delta, weight, y, xs, i32(SPLIT_CODE[split]),
                                                                i32(cols), f32(eps)))
    return result


def reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """numpy_ops.rms_norm."""
    return numpy_ops.rms_norm(x, weight, eps)


def reference_add(x: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x + delta, rms_norm(x + delta)): the updated residual and the normed row."""
    s = (x + delta).astype(np.float32)
    return s, numpy_ops.rms_norm(s, weight, eps)
