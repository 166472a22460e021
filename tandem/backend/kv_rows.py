"""KV rows in their storage on the host: float32, or bfloat16 bits (uint16 arrays) rounded when written.

A bf16 row is written rounded to nearest even (tandem/dtypes.py f32_to_bf16, the rounding the CUDA kernels'
kv_store does: cuda/attention_common.cuh) and widened exactly when read, so the CPU engine and the GPU hold and
attend to the same values: GPU == CPU greedy for either storage (DESIGN.md, "Exactness"). The storage is the
buffer's dtype: float32 or uint16.
"""

from __future__ import annotations

import numpy as np

from tandem.dtypes import bf16_to_f32, f32_to_bf16


def _check(buf: np.ndarray) -> None:
    if buf.dtype != np.float32 and buf.dtype != np.uint16:
        raise TypeError(f"KV rows must be float32 or uint16 (bfloat16 bits), got {buf.dtype}")


def write_rows(buf: np.ndarray, start: int, rows: np.ndarray) -> None:
    """buf[start : start + T] := rows [T, ...] float32, rounded to bf16 when ``buf`` is uint16. Raises TypeError for
    another buffer dtype."""
    _check(buf)
    end = start + rows.shape[0]
    buf[start:end] = rows if buf.dtype == np.float32 else f32_to_bf16(np.asarray(rows, dtype=np.float32))


def read_rows(buf: np.ndarray, end: int, start: int = 0) -> np.ndarray:
    """Rows [start, end) of ``buf`` as float32 (the stored values: a view for float32, widened bf16 bits for uint16).
    Raises TypeError for another buffer dtype."""
    _check(buf)
    rows = buf[start:end]
    return rows if buf.dtype == np.float32 else bf16_to_f32(np.ascontiguousarray(rows))


def round_rows(x: np.ndarray, storage: np.dtype) -> np.ndarray:
    """The values rows ``x`` float32 hold once stored as ``storage`` (float32: x itself; uint16: rounded to bf16,
    widened back). Raises TypeError for another storage."""
    if storage == np.float32:
        return x
    if storage == np.uint16:
        return bf16_to_f32(f32_to_bf16(np.asarray(x, dtype=np.float32)))
    raise TypeError(f"KV rows must be float32 or uint16 (bfloat16 bits), got {storage}")
