"""The prefill's projections on tensor cores: weights dequantised to bf16, then cuBLAS bf16 GEMMs with fp32
accumulation (kernels: cuda/prefill_gemm.cu ``dequant_*``, ``f32_to_b16``; cuBLAS ``cublasGemmEx`` through CuPy).

A prefill chunk's rows go through ``gemm_b16``: C [M, N] float32 = A [M, K] · Wᵀ with A and W bf16 (uint16 bits),
fp32 compute. The exactness contract (docs/architecture.md, "Exactness") asks that a row's bits not depend on how
many rows ran beside it. cuBLAS gives no such promise, but at the 27B shapes its bf16 GEMM was measured row-invariant
for every call of at least 256 rows (shared/measured/gemm-row-invariance.md, H100, CuPy 14); below 256 rows one shape
rounded otherwise. So every call has at least ``MIN_ROWS`` rows (the caller pads A with zero rows), and
``row_invariant`` checks each (K, N) shape once on the device it runs on: the rows of a ``MIN_ROWS``-row call, and of
a longer call at an odd offset, must equal the same rows of one long call bit for bit; a shape that fails is
reported (``RowInvarianceError``) so the model prefills with its row-invariant GEMVs instead.

Weights: ``bf16_weight`` writes any device Linear (tandem/backend/cuda/gemv.py: BF16, FP8 block-scaled, NVFP4; the
fp32 fallback of upload.py) as W [out, in] bf16 bits, read straight from the GEMV's stored layout (tile-major, the
NVFP4 pair layout): BF16 is copied, FP8 is code · block scale rounded once to fp32 then to bf16, NVFP4 is (E2M1 ·
E4M3 scale) · (row scale · 2^-14) likewise (the first product is exact). A glu_pair Linear's interleaved gate / up
rows come out as [gate; up], the layout ``silu_mul_rows`` reads. The NumPy twins (``reference_*``) compute the same
bits on the host; tests/test_cuda_prefill.py compares them bit for bit and the GEMM against float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import i32, require
from tandem.backend.cuda.loader import cupy, kernel
from tandem.backend.cuda.upload import CudaF32Linear
from tandem.backend.cuda.gemv import CudaDenseLinear, CudaFP8BlockLinear, CudaNVFP4Linear
from tandem.dtypes import bf16_to_f32, e2m1_to_f32, e4m3_to_f32, f32_to_bf16

KERNELS = ("dequant_bf16", "dequant_fp8", "dequant_nvfp4", "f32_to_b16")
THREADS = 256
MAX_BLOCKS = 8192
MIN_ROWS = 256  # the fewest rows a prefill GEMM call has (shared/measured/gemm-row-invariance.md)
# cuBLAS constants (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_R_16BF, _R_32F = 14, 0
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1


class RowInvarianceError(RuntimeError):
    """cuBLAS's bf16 GEMM gave a row other bits in a call of another row count (``row_invariant``)."""


def weight_shape(lin: Any) -> tuple[int, int]:
    """(out, in) of a device Linear."""
    return int(lin.shape[0]), int(lin.shape[1])


def bf16_weight(lin: Any, out: Any = None) -> Any:
    """W [out, in] uint16 (bf16 bits, row-major) of a device Linear, one launch (module docstring).

    Args: lin: CudaDenseLinear, CudaFP8BlockLinear, CudaNVFP4Linear or CudaF32Linear; out: optional C-contiguous
    uint16 buffer of out · in elements (any shape), viewed as [out, in]. A ``glu`` Linear (gemv.glu_pair) gives
    rows [gate (F); up (F)]. Raises: ValueError on an unknown Linear or a bad ``out``."""
    cp = cupy()
    rows, cols = weight_shape(lin)
    if out is None:
        w = cp.empty((rows, cols), dtype=cp.uint16)
    else:
        if out.dtype != np.uint16 or not out.flags.c_contiguous or out.size < rows * cols:
            raise ValueError(f"out: expected a C-contiguous uint16 buffer of at least {rows * cols} elements")
        w = out.reshape(-1)[:rows * cols].reshape(rows, cols)
    glu = int(getattr(lin, "glu", 0))
    if isinstance(lin, CudaF32Linear):
        n = rows * cols
        kernel("prefill_gemm", "f32_to_b16")((min(MAX_BLOCKS, -(-n // THREADS)),), (THREADS,),
                                        (lin.weight, w, np.int64(n)))
        return w
    row_bytes = {"bf16": 2 * cols, "fp8": cols, "nvfp4": cols // 2}[lin.fmt]
    groups = rows * row_bytes // 16
    grid = (min(MAX_BLOCKS, -(-groups // THREADS)),)
    tail = (w, i32(rows), i32(cols), i32(int(lin.tiled)), i32(glu))
    if isinstance(lin, CudaDenseLinear):
        kernel("prefill_gemm", "dequant_bf16")(grid, (THREADS,), (lin.bits,) + tail)
    elif isinstance(lin, CudaFP8BlockLinear):
        kernel("prefill_gemm", "dequant_fp8")(grid, (THREADS,), (lin.codes, lin.scale8) + tail)
    elif isinstance(lin, CudaNVFP4Linear):
        kernel("prefill_gemm", "dequant_nvfp4")(grid, (THREADS,), (lin.packed, lin.scales, lin.row_scale) + tail)
    else:
        raise ValueError(f"no bf16 weight for {type(lin).__name__}")
    return w


def gemm_b16(a: Any, w: Any, out: Any) -> Any:
    """out [M, N] float32 = a [M, K] · wᵀ (bf16 operands as uint16 bits, fp32 accumulation; cublasGemmEx, default
    algorithm, on the current stream). Every row of ``a`` is computed (pad short chunks to ``MIN_ROWS`` rows with
    zeros: rows are independent). Raises: ValueError on bad dtypes / shapes."""
    cp = cupy()
    require("a", a, np.uint16, (None, None))
    m, k = (int(d) for d in a.shape)
    require("w", w, np.uint16, (None, k))
    n = int(w.shape[0])
    require("out", out, np.float32, (m, n))
    from cupy_backends.cuda.libs import cublas

    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    # column-major: Cᵀ [N, M] = (W [N, K] row-major = Wᵀ col-major)ᵀ · Aᵀ
    cublas.gemmEx(handle, _OP_T, _OP_N, n, m, k, one.ctypes.data, w.data.ptr, _R_16BF, k, a.data.ptr, _R_16BF, k,
                  zero.ctypes.data, out.data.ptr, _R_32F, n, _COMPUTE_32F, _GEMM_DEFAULT)
    return out


_invariant: dict[tuple[int, int, int], bool] = {}


def row_invariant(k: int, n: int, max_rows: int) -> bool:
    """Whether cuBLAS's bf16 GEMM of shape [M, k] · [n, k]ᵀ gives every row the same bits for every M in
    [MIN_ROWS, max_rows], as far as one check shows: random rows, calls of MIN_ROWS rows and of
    ``max(MIN_ROWS, max_rows - 37)`` rows at offset 37 against one ``max_rows``-row call. Cached per (k, n, max_rows)
    and device."""
    cp = cupy()
    key = (int(k), int(n), int(cp.cuda.runtime.getDevice()) * 1_000_000 + int(max_rows))
    if key in _invariant:
        return _invariant[key]
    total = max(int(max_rows), MIN_ROWS + 37)
    rng = cp.random.default_rng(1234)
    a = (rng.standard_normal((total, k), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    w = ((rng.standard_normal((n, k), dtype=cp.float32) * 0.02).view(cp.uint32) >> 16).astype(cp.uint16)
    full = gemm_b16(a, w, cp.empty((total, n), dtype=cp.float32))
    ok = True
    for off, rows in ((0, MIN_ROWS), (37, max(MIN_ROWS, total - 37))):
        part = gemm_b16(cp.ascontiguousarray(a[off:off + rows]), w, cp.empty((rows, n), dtype=cp.float32))
        ok = ok and bool(cp.array_equal(part.view(cp.uint32), full[off:off + rows].view(cp.uint32)))
    _invariant[key] = ok
    del a, w, full
    return ok


# ---------------------------------------------------------------------------------------------- NumPy twins
def reference_bf16_weight(lin: Any) -> np.ndarray:
    """NumPy twin of ``bf16_weight``: the same bits [out, in] uint16 from the Linear's host-side fields (its codes
    and scales as row-major host arrays)."""
    cp = cupy()
    glu = int(getattr(lin, "glu", 0))
    if isinstance(lin, CudaF32Linear):
        w = f32_to_bf16(cp.asnumpy(lin.weight))
    elif isinstance(lin, CudaDenseLinear):
        w = cp.asnumpy(lin.rows())
    elif isinstance(lin, CudaFP8BlockLinear):
        codes = cp.asnumpy(lin.rows())
        scale = np.repeat(np.repeat(cp.asnumpy(lin.scale8), 8, axis=0)[:codes.shape[0]], 128, axis=1)
        w = f32_to_bf16((e4m3_to_f32(codes) * scale[:, :codes.shape[1]]).astype(np.float32))
    elif isinstance(lin, CudaNVFP4Linear):
        packed = cp.asnumpy(lin.rows())
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        sc = np.repeat(e4m3_to_f32(cp.asnumpy(lin.scale_codes)), 16, axis=1)
        rs = (cp.asnumpy(lin.row_scale) * np.float32(2.0 ** -14)).astype(np.float32)
        w = f32_to_bf16(((e2m1_to_f32(codes) * sc).astype(np.float32) * rs[:, None]).astype(np.float32))
    else:
        raise ValueError(f"no bf16 weight for {type(lin).__name__}")
    if glu:
        f = glu
        groups = w.reshape(2 * f // 16, 2, 8, -1)
        w = np.concatenate([groups[:, 0].reshape(f, -1), groups[:, 1].reshape(f, -1)])
    return np.ascontiguousarray(w, dtype=np.uint16)


def reference_gemm(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 a · wᵀ of bf16 bits a [M, K], w [N, K] (uint16), as float32: what ``gemm_b16`` approximates (fp32
    accumulation: relative error ~1e-6 of the row's magnitude)."""
    return (bf16_to_f32(a).astype(np.float64) @ bf16_to_f32(w).astype(np.float64).T).astype(np.float32)
