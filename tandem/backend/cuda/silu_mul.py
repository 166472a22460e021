"""SiLU · mul (the MLP activation) on the GPU. Kernel: cuda/silu_mul.cu.

Reference: numpy_ops.silu(gate) * up; relative error ≤ 1e-6 (accurate expf). Elementwise, so row-invariant.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.cuda.arrays import i32, out_or_new, require
from tandem.backend.cuda.operand import SPLIT_CODE, split_operand
from tandem.backend.cuda.loader import kernel

KERNELS = ("silu_mul", "silu_mul_rows")
THREADS = 256
MAX_BLOCKS = 4096


def silu_mul(gate: Any, up: Any, out: Any = None) -> Any:
    """y = gate / (1 + exp(-gate)) · up. Args: gate, up [...] float32 (same shape, device).
    Returns: float32 of that shape. Raises: ValueError on mismatched dtype / shape."""
    require("gate", gate, np.float32, tuple(gate.shape))
    require("up", up, np.float32, tuple(gate.shape))
    y = out_or_new("out", out, tuple(gate.shape))
    n = int(gate.size)
    if n:
        blocks = min(MAX_BLOCKS, -(-n // THREADS))
        kernel("silu_mul", "silu_mul")((blocks,), (THREADS,), (gate, up, y, np.int64(n)))
    return y


def silu_mul_rows(gu: Any, out: Any = None, split: str | None = None) -> Any:
    """silu(gate) · up of the fused gate|up projection gu [T, 2F] (gate = columns :F, up = F:).

    Returns: y [T, F] float32, or with ``split`` (a GEMV operand kind) the down projection's xs [T, P, F] uint16.
    Raises: ValueError on a bad dtype / shape.
    """
    require("gu", gu, np.float32, (None, None))
    rows, width2 = (int(n) for n in gu.shape)
    if width2 % 2:
        raise ValueError(f"gu: needs an even width (gate | up), got {width2}")
    width = width2 // 2
    if split is None:
        y, xs, result = out_or_new("out", out, (rows, width)), None, None
        result = y
    else:
        xs = split_operand(split, out, rows, width)
        y, result = None, xs
    n = rows * width
    if n:
        blocks = min(MAX_BLOCKS, -(-n // THREADS))
        kernel("silu_mul", "silu_mul_rows")((blocks,), (THREADS,), (gu, y, xs, i32(SPLIT_CODE[split]), i32(rows),
                                                                     i32(width)))
    return result


def reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """numpy_ops.silu(gate) * up, float32."""
    return np.asarray(numpy_ops.silu(gate) * up, dtype=np.float32)
