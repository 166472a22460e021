"""Linear weights: every matrix the model multiplies by, whatever its storage format (DESIGN.md layer 3).

A `Linear` holds W with shape [out, in] (PyTorch convention) and computes y = x · Wᵀ in float32.
Weights are converted exactly to float32 at load (spec/qwen3_5.md §9 for FP8 block scales).

Row invariance (DESIGN.md, "matrix rows"): `matmul` gives row i the same bits whatever the other rows are and
however many there are, so prefill (many rows), decode (one) and verify (a tree's nodes) agree bit for bit. A BLAS
GEMM's row depends on the row count M (OpenBLAS forwards M = 1 to GEMV and takes its small-matrix kernel or its
blocked kernel by M·N·K, which round differently), but at a fixed M, K and N row i depends only on x[i], wherever
it sits in the block (measured; tests/test_row_blocks.py checks it for the BLAS in use). So every Linear has one
row block `row_block` (B, fixed by its shape): x is cut into blocks of exactly B rows, the last one padded with
zeros, and each block is one GEMM of B rows, all blocks in one stacked matmul call. B = 1 is one GEMV per row
(weights too large for a cheap small GEMM: decode stays a GEMV); B ≥ 2 is chosen with B·N·K ≤ 2^20, where a
B-row GEMM costs a decode little more than a GEMV and prefill runs at GEMM speed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from tandem.checkpoint import CheckpointError
from tandem.dtypes import e4m3_to_f32

F32Array = npt.NDArray[np.float32]

FP8_BLOCK = 128
MAX_ROW_BLOCK = 2  # the largest row block (bench/prefill_rows.py: larger blocks cost decode more than prefill gains)
SMALL_GEMM = 1 << 20  # B·N·K at most this: the B-row GEMM stays in BLAS's small-matrix range
SPLIT_ROWS = 32  # a call of at least this many rows runs half its blocks on a second thread (BLAS releases the GIL)
_pool: list[ThreadPoolExecutor] = []


def _second_thread() -> ThreadPoolExecutor | None:
    """One worker thread for the other half of a long call's blocks; None on a one-core machine."""
    if not _pool and (os.cpu_count() or 1) > 1:
        _pool.append(ThreadPoolExecutor(1, thread_name_prefix="tandem-gemm"))
    return _pool[0] if _pool else None


def row_block(shape: tuple[int, int]) -> int:
    """The row block B of a weight [out, in]: the largest power of two ≤ MAX_ROW_BLOCK with B·out·in ≤ 2^20,
    or 1 (one GEMV per row) when even B = 2 exceeds it. A function of the shape only, so every process (and every
    snapshot it writes) computes the same bits."""
    b = 1
    while b < MAX_ROW_BLOCK and 2 * b * shape[0] * shape[1] <= SMALL_GEMM:
        b *= 2
    return b


@runtime_checkable
class Linear(Protocol):
    """A weight matrix W [out, in] that the model multiplies by; the model never asks for its format.

    Attributes:
        shape: (out, in).
        bytes_per_use: bytes of the weight representation read by one matmul call.
    """

    shape: tuple[int, int]
    bytes_per_use: int

    def matmul(self, x: F32Array) -> F32Array:
        """y = x · Wᵀ, row-invariant (row i's bits depend on x[i] only). x: [T, in] float32 -> [T, out] float32."""
        ...


def _check_x(x: F32Array, shape: tuple[int, int], label: str) -> None:
    if x.ndim != 2 or x.shape[1] != shape[1] or x.dtype != np.float32:
        raise ValueError(
            f"{label}: x must be [T, {shape[1]}] float32, got {list(x.shape)} {x.dtype}")


class DenseLinear:
    """A float32 weight [out, in], exact widening of BF16/F16/F32 storage.

    Layout: with row block B = 1, W row-major [out, in] (one GEMV per row reads it); with B ≥ 2, Wᵀ row-major
    [in, out] (the B-row GEMM's operand, no transpose flag) and ``weight`` is its [out, in] view. C-contiguous
    float32 either way, one copy.
    Reference: float64 x · Wᵀ; float32 result within ~1e-6 relative (fp32 accumulation).
    """

    def __init__(self, weight: F32Array, name: str = "<linear>") -> None:
        """Args: weight [out, in] float32; name used in error messages. Raises ValueError if not 2-D float32."""
        if weight.ndim != 2 or weight.dtype != np.float32:
            raise ValueError(f"{name}: weight must be 2-D float32, got {list(weight.shape)} {weight.dtype}")
        self.name = name
        self.shape: tuple[int, int] = (int(weight.shape[0]), int(weight.shape[1]))
        self.row_block: int = row_block(self.shape)
        self._w: F32Array = np.ascontiguousarray(weight if self.row_block == 1 else weight.T)
        self.bytes_per_use: int = int(self._w.nbytes)
        self._row = np.empty(self.shape[1], dtype=np.float32)

    @property
    def weight(self) -> F32Array:
        """W [out, in] float32 (a transposed view when the stored layout is Wᵀ)."""
        return self._w if self.row_block == 1 else self._w.T

    def matmul(self, x: F32Array) -> F32Array:
        """y = x · Wᵀ in row blocks of ``row_block`` rows (module docstring), so row i's bits depend on x[i] only.

        Args: x [T, in] float32. Returns: [T, out] float32. Raises: ValueError on a wrong shape/dtype.
        """
        _check_x(x, self.shape, self.name)
        t, b = x.shape[0], self.row_block
        if b == 1:
            out = np.empty((t, self.shape[0]), dtype=np.float32)
            row = self._row
            for i in range(t):
                # Copy into one fixed buffer so alignment (which some BLAS kernels branch on) never varies.
                row[...] = x[i]
                np.dot(self._w, row, out=out[i])
            return out
        blocks = -(-t // b)
        padded = np.zeros((blocks, b, self.shape[1]), dtype=np.float32)
        padded.reshape(blocks * b, self.shape[1])[:t] = x
        y = np.empty((blocks, b, self.shape[0]), dtype=np.float32)
        pool = _second_thread() if t >= SPLIT_ROWS else None
        if pool is None:
            np.matmul(padded, self._w, out=y)
        else:  # the same B-row GEMMs, half of them on the worker: the same bits
            half = blocks // 2
            done = pool.submit(np.matmul, padded[:half], self._w, out=y[:half])
            np.matmul(padded[half:], self._w, out=y[half:])
            done.result()
        flat = y.reshape(blocks * b, self.shape[0])
        return flat[:t] if blocks * b != t else flat


def dequantize_fp8_block(codes_f32: F32Array, scale: F32Array, name: str = "<linear>") -> F32Array:
    """W[i, j] = f32(Wq[i, j]) · f32(S[i // 128, j // 128]), one float32 multiply (spec §9).

    Exact for BF16 scales (4 + 8 significant bits fit float32); with F32 scales, one correctly rounded product.

    Args:
        codes_f32: [out, in] float32, the decoded E4M3 values.
        scale: [ceil(out/128), ceil(in/128)] float32 (`weight_scale_inv`; multiply despite the name).
    Returns:
        [out, in] float32.
    Raises:
        CheckpointError: scale shape does not match the weight's block grid (names the tensor).
    """
    out_dim, in_dim = codes_f32.shape
    grid = (-(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK))
    if scale.shape != grid:
        raise CheckpointError(
            f"{name}.weight_scale_inv has shape {list(scale.shape)}, expected {list(grid)} for weight "
            f"[{out_dim}, {in_dim}] with 128x128 blocks")
    expanded = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:out_dim, :in_dim]
    w: F32Array = codes_f32 * expanded
    return w


class FP8BlockLinear(DenseLinear):
    """FP8 E4M3 weight with 128×128 block scales, dequantized exactly to float32 at load (spec §9).

    Layout: W row-major [out, in] float32 (dequantized); `stored_bytes` is the checkpoint's fp8 codes plus
    scales; `bytes_per_use` is the float32 array `matmul` reads.
    Reference: float64 x · (f32(Wq) ⊙ expand(S))ᵀ.
    """

    def __init__(self, codes: npt.NDArray[np.uint8], scale: F32Array, scale_stored_bytes: int,
                 name: str = "<linear>") -> None:
        """Args: codes [out, in] uint8 (E4M3 bits); scale [ceil(out/128), ceil(in/128)] float32;
        scale_stored_bytes as stored (BF16 or F32). Raises CheckpointError on a scale-grid mismatch."""
        weight = dequantize_fp8_block(e4m3_to_f32(codes), scale, name)
        super().__init__(weight, name)
        self.stored_bytes: int = int(codes.nbytes) + scale_stored_bytes
