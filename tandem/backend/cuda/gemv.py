"""Row-invariant GEMV / skinny GEMM (1–64 rows) on the GPU for BF16, FP8 block-scaled and NVFP4 weights.

Kernel: cuda/gemv.cu. Each class mirrors the host `Linear` protocol (tandem/formats): `shape` (out, in),
`bytes_per_use` (weight bytes one call reads: codes + scales as stored) and `matmul(x)` with x [T, in] float32 on
the device. Row t of the result has the same bits for any T (the kernel's reduction order depends only on `in`).

Reference (`reference_*`): float64 x · Wᵀ with W dequantized by the host formats (tandem.dtypes.bf16_to_f32,
tandem.formats.dequantize_fp8_block, tandem.formats.dequantize_nvfp4); fp32 accumulation keeps the relative
error near 1e-6 (tests bound it by 1e-5).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel
from tandem.dtypes import bf16_to_f32
from tandem.formats import dequantize_fp8_block, dequantize_nvfp4

KERNELS = ("gemv_bf16_t##TT", "gemv_fp8_t##TT", "gemv_nvfp4_t##TT")
ROWS_PER_BLOCK = 16  # 8 warps × 2 output rows (cuda/gemv.cu)
THREADS = 256


def row_tile(num_rows: int) -> int:
    """Rows of x that share one weight read: 1, 2, 4 or 8 (does not change any row's bits)."""
    return 1 if num_rows == 1 else 2 if num_rows == 2 else 4 if num_rows <= 4 else 8


def _launch(fmt: str, out_dim: int, x: Any, out: Any, args: tuple[Any, ...]) -> Any:
    num_rows, in_dim = x.shape
    y = out_or_new("out", out, (num_rows, out_dim))
    tt = row_tile(num_rows)
    grid = (-(-out_dim // ROWS_PER_BLOCK), -(-num_rows // tt))
    kernel("gemv", f"gemv_{fmt}_t{tt}")(grid, (THREADS,), (*args, x, y, i32(out_dim), i32(in_dim), i32(num_rows)))
    return y


def _check_x(x: Any, in_dim: int) -> None:
    require("x", x, np.float32, (None, in_dim))
    if x.shape[0] < 1:
        raise ValueError("x: needs at least one row")


class CudaDenseLinear:
    """BF16 weight W [out, in] on the device (uint16 bits). Layout: row-major, in % 8 == 0."""

    def __init__(self, bits: Any) -> None:
        """Args: bits [out, in] uint16 (BF16), NumPy or CuPy. Raises ValueError on a bad dtype / shape."""
        cp = cupy()
        self.bits = cp.ascontiguousarray(cp.asarray(bits))
        require("bits", self.bits, np.uint16, (None, None))
        out_dim, in_dim = self.bits.shape
        if in_dim % 8:
            raise ValueError(f"BF16 GEMV needs in % 8 == 0 (16-byte rows), got in = {in_dim}")
        self.shape = (int(out_dim), int(in_dim))
        self.bytes_per_use = int(self.bits.nbytes)

    def matmul(self, x: Any, out: Any = None) -> Any:
        """y = x · Wᵀ. Args: x [T, in] float32 (device). Returns: [T, out] float32. Raises: ValueError."""
        _check_x(x, self.shape[1])
        return _launch("bf16", self.shape[0], x, out, (self.bits,))


class CudaFP8BlockLinear:
    """FP8 E4M3 weight [out, in] with 128×128 block scales [ceil(out/128), ceil(in/128)] fp32 (multiplied)."""

    def __init__(self, codes: Any, scale: Any) -> None:
        """Args: codes [out, in] uint8; scale float32 grid. Raises ValueError on bad dtypes / shapes."""
        cp = cupy()
        self.codes = cp.ascontiguousarray(cp.asarray(codes))
        self.scale = cp.ascontiguousarray(cp.asarray(scale, dtype=cp.float32))
        require("codes", self.codes, np.uint8, (None, None))
        out_dim, in_dim = self.codes.shape
        require("scale", self.scale, np.float32, (-(-out_dim // 128), -(-in_dim // 128)))
        if in_dim % 16:
            raise ValueError(f"FP8 GEMV needs in % 16 == 0 (16-byte rows), got in = {in_dim}")
        self.shape = (int(out_dim), int(in_dim))
        self.bytes_per_use = int(self.codes.nbytes + self.scale.nbytes)

    def matmul(self, x: Any, out: Any = None) -> Any:
        """y = x · (f32(codes) ⊙ expand(scale))ᵀ. Args: x [T, in] float32. Returns [T, out] float32."""
        _check_x(x, self.shape[1])
        return _launch("fp8", self.shape[0], x, out, (self.codes, self.scale))


class CudaNVFP4Linear:
    """NVFP4 weight: packed E2M1 [out, in/2] (low nibble first), E4M3 scales [out, in/16], fp32 global scale."""

    def __init__(self, packed: Any, scale_codes: Any, global_scale: float, divide: bool = False) -> None:
        """Args: packed uint8; scale_codes uint8 (E4M3 bits); global_scale (a divisor with ``divide``, the
        compressed-tensors convention). Raises ValueError on bad dtypes / shapes or in % 32 != 0."""
        cp = cupy()
        self.packed = cp.ascontiguousarray(cp.asarray(packed))
        require("packed", self.packed, np.uint8, (None, None))
        out_dim, half = self.packed.shape
        in_dim = 2 * half
        if in_dim % 32:
            raise ValueError(f"NVFP4 GEMV needs in % 32 == 0 (16-byte rows), got in = {in_dim}")
        self.scale_codes = cp.ascontiguousarray(cp.asarray(scale_codes))
        require("scale_codes", self.scale_codes, np.uint8, (out_dim, in_dim // 16))
        self.global_scale = float(np.float32(global_scale))
        self.divide = bool(divide)
        self.shape = (int(out_dim), int(in_dim))
        self.bytes_per_use = int(self.packed.nbytes + self.scale_codes.nbytes + 4)

    def matmul(self, x: Any, out: Any = None) -> Any:
        """y = x · Wᵀ, W = e2m1 · e4m3 · global (or / global). Args: x [T, in] float32. Returns [T, out]."""
        _check_x(x, self.shape[1])
        scale16 = self.scale_codes.view(np.uint16)
        return _launch("nvfp4", self.shape[0], x, out,
                       (self.packed, scale16, f32(self.global_scale), i32(int(self.divide))))


def reference_bf16(bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 x · f32(bits)ᵀ. bits [out, in] uint16, x [T, in] float32 -> [T, out] float64."""
    return np.asarray(x, np.float64) @ bf16_to_f32(bits).astype(np.float64).T


def reference_fp8(codes: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 x · dequantize_fp8_block(codes, scale)ᵀ -> [T, out] float64."""
    from tandem.dtypes import e4m3_to_f32

    w = dequantize_fp8_block(e4m3_to_f32(codes), scale.astype(np.float32))
    return np.asarray(x, np.float64) @ w.astype(np.float64).T


def reference_nvfp4(packed: np.ndarray, scale_codes: np.ndarray, global_scale: float, x: np.ndarray,
                    divide: bool = False) -> np.ndarray:
    """float64 x · dequantize_nvfp4(packed, scale_codes, global_scale)ᵀ -> [T, out] float64."""
    w = dequantize_nvfp4(packed, scale_codes, global_scale, divide=divide)
    return np.asarray(x, np.float64) @ w.astype(np.float64).T
