"""The split operand a tensor-core GEMV reads: x [T, in] float32 as xs [T, P, in] uint16 (P parts), and the column
pieces of a fused projection's output.

Kernels (in cuda/gemv.cu, listed in gemv.KERNELS): gemv_prep (``prepare``), gemv_split_cols (``split_pieces``).
Every launcher that writes a GEMV's operand (rms_norm, silu_mul, attention_decode, attention_tree, gdn_seq, embed)
takes its buffer from ``split_operand`` here, so none of them needs gemv.py.
Layout (common.cuh store_split): kind "f16": fp16 hi, lo (x = hi + lo to 22 bits; needs |x| < 65504); "f16p": the
same in NVFP4 slot order; "bf16": bf16 hi, mid, lo (24 bits, any range); "b16": one bf16, rounded to nearest even
(not a GEMV kind: the operand of the prefill's bf16 GEMMs, tandem/backend/cuda/prefill_gemm.py).
Reference: tests/test_cuda_gemv.py checks ``prepare`` through the GEMVs that read it (gemv.reference_*).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel

THREADS = 256  # block size of gemv_prep and gemv_split_cols
PARTS = {"bf16": 3, "f16": 2, "f16p": 2, "b16": 1}
SPLIT_CODE = {None: 0, "f16": 1, "f16p": 2, "bf16": 3, "b16": 4}  # common.cuh SPLIT_* (kernels that write xs take these)
NULL = np.uint64(0)  # a null device pointer argument


def split_operand(split: str, out: Any, rows: int, width: int, name: str = "out") -> Any:
    """The buffer a kernel writes a GEMV operand into: xs [rows, P, width] uint16 for split kind ``split``
    (a PREP_KIND value, P = PARTS[split]; common.cuh store_split's layout), ``out`` checked or a new array.
    Every launcher that can write the next GEMV's operand takes its buffer from here.
    Raises: ValueError on an unknown split kind or a bad ``out`` (named ``name``)."""
    if split not in PARTS:
        raise ValueError(f"split: expected one of {sorted(PARTS)} or None, got {split!r}")
    shape = (rows, PARTS[split], width)
    if out is None:
        return cupy().empty(shape, dtype=np.uint16)
    require(name, out, np.uint16, shape)
    return out


def prepare(x: Any, kind: str, out: Any = None) -> Any:
    """Split x [T, in] float32 into the v2 kernels' B operand xs [T, P, in] uint16 (one launch).

    kind "f16": fp16 hi, lo (x = hi + lo to 22 bits; needs |x| < 65504); "f16p": the same in NVFP4 slot order;
    "bf16": bf16 hi, mid, lo (24 bits, any range). Linears whose ``prep_kind`` match can share one xs.
    """
    num_rows, in_dim = x.shape
    parts = PARTS[kind]
    cp = cupy()
    xs = out if out is not None else cp.empty((num_rows, parts, in_dim), dtype=np.uint16)
    n = num_rows * in_dim
    grid = (min(-(-n // THREADS), 4096),)
    kernel("gemv", "gemv_prep")(grid, (THREADS,), (x, xs, i32(num_rows), i32(in_dim), i32(SPLIT_CODE[kind])))
    return xs


def split_cols(y: Any, col0: int, n: int, out: Any = None) -> Any:
    """Columns [col0, col0 + n) of y [T, W] float32 as a C-contiguous [T, n] float32 (one launch): a piece of a
    ``concat`` Linear's output. Raises ValueError on a bad dtype / shape or columns outside y."""
    return split_pieces(y, [n], [out], col0)[0]


def split_pieces(y: Any, sizes: Sequence[int], outs: Sequence[Any] | None = None, col0: int = 0) -> list[Any]:
    """Consecutive column pieces of y [T, W] float32 from ``col0``, of widths ``sizes`` (1 to 4 pieces), each as a
    C-contiguous [T, n] float32 (into ``outs[k]`` where given), in ONE launch (cuda/gemv.cu gemv_split_cols).
    Raises ValueError on a bad dtype / shape, no piece or more than 4, or columns outside y."""
    require("y", y, np.float32, (None, None))
    rows, width = (int(d) for d in y.shape)
    if not 1 <= len(sizes) <= 4 or min(sizes) < 1:
        raise ValueError(f"pieces {list(sizes)}: need 1 to 4 pieces of at least one column")
    end = col0 + sum(sizes)
    if col0 < 0 or end > width:
        raise ValueError(f"columns [{col0}, {end}) outside y's {width}")
    dsts, ends, pos = [], [], col0
    for k, n in enumerate(sizes):
        dsts.append(out_or_new(f"outs[{k}]", outs[k] if outs is not None else None, (rows, n)))
        pos += n
        ends.append(pos)
    ptrs = dsts + [NULL] * (4 - len(dsts))
    ends += [end] * (4 - len(ends))
    grid = (min(-(-rows * (end - col0) // THREADS), 4096),)
    kernel("gemv", "gemv_split_cols")(grid, (THREADS,), (y, i32(rows), i32(width), i32(col0), i32(len(sizes)),
                                                         *(i32(e) for e in ends), *ptrs))
    return dsts
