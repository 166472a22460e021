"""Linear weights: every matrix the model multiplies by, whatever its storage format (DESIGN.md layer 3).

A `Linear` holds W with shape [out, in] (PyTorch convention) and computes y = x · Wᵀ in float32.
Weights are converted exactly to float32 at load (spec/qwen3_5.md §9 for FP8 block scales).

Row invariance (DESIGN.md, "matrix rows"): `matmul` gives row i the same bits whatever the other rows are and
however many there are, so prefill (many rows), decode (one) and verify (a tree's nodes) agree bit for bit. A BLAS
GEMM's row depends on the kernel BLAS picks: OpenBLAS forwards M = 1 to GEMV, and its small-matrix kernel (taken
while M·N·K ≤ 100^3, the NN form that Wᵀ row-major gives) differs from its blocked one. Inside the small-matrix
kernel each output element of its 16-column tiles is one FMA chain over k from zero
(kernel/x86_64/sgemm_small_kernel_nn_skylakex.c), so on a width that is a multiple of 16 row i's bits depend on
x[i] only, for any row count B ≥ 2 and wherever x[i] sits in the block, and not on which other output columns are
computed in the same call; narrower or ragged widths keep one fixed block of 2 rows, whose bits depend on the row
only (tests/test_prefill_rows.py checks all of this for the BLAS in use). So a Linear with ``row_block`` 2 keeps Wᵀ
as column slabs (``slabs``: multiples of 64 columns, each small enough for blocks of 4 rows) and multiplies each
slab by blocks of ``prefill_block`` rows (2 to 16, a function of the slab's shape), one stacked matmul call per
slab, the remaining rows as one block (a single row padded with a zero row); decode's one row is such a padded
2-row block. ``row_block`` 1 (weights too large for a cheap 2-row GEMM: 2·N·K > 2^20) is one GEMV per row for
every call: decode stays a GEMV.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from tandem.checkpoint import CheckpointError
from tandem.dtypes import e4m3_to_f32

F32Array = npt.NDArray[np.float32]

FP8_BLOCK = 128
MAX_ROW_BLOCK = 2  # decode's row block (bench/prefill_rows.py: larger blocks cost decode more than prefill gains)
SMALL_GEMM = 1 << 20  # 2·N·K at most this: a 2-row GEMM costs a decode little more than a GEMV (else row_block 1)
SMALL_KERNEL = 100 ** 3  # B·N·K at most this: OpenBLAS's small-matrix kernel (its sgemm_small_kernel_permit)
SLAB_BLOCK = 4  # column slabs are sized so that blocks of this many rows stay in the small-matrix kernel
MAX_PREFILL_BLOCK = 16  # the largest row block of a call of many rows
SLAB_COLUMNS = 64  # slab widths are multiples of this (the small kernel's widest column tile)


def row_block(shape: tuple[int, int]) -> int:
    """The row block B of a weight [out, in]: the largest power of two ≤ MAX_ROW_BLOCK with B·out·in ≤ 2^20,
    or 1 (one GEMV per row) when even B = 2 exceeds it. A function of the shape only, so every process (and every
    snapshot it writes) computes the same bits."""
    b = 1
    while b < MAX_ROW_BLOCK and 2 * b * shape[0] * shape[1] <= SMALL_GEMM:
        b *= 2
    return b


def slab_bounds(shape: tuple[int, int]) -> list[tuple[int, int]]:
    """The column slabs [start, stop) of Wᵀ for a weight [out, in] of row block 2: as few equal slabs (widths
    multiples of SLAB_COLUMNS, the last one shorter) as keep SLAB_BLOCK·width·in ≤ SMALL_KERNEL. A function of the
    shape only."""
    out, k = shape
    widest = max(SLAB_COLUMNS, SMALL_KERNEL // (SLAB_BLOCK * k) // SLAB_COLUMNS * SLAB_COLUMNS)
    count = -(-out // widest)
    per_slab = -(-out // count)
    width = min(out, -(-per_slab // SLAB_COLUMNS) * SLAB_COLUMNS)
    return [(a, min(out, a + width)) for a in range(0, out, width)]


def prefill_block(width: int, k: int) -> int:
    """The row block of a call of many rows on a slab [k, width]: the largest power of two ≤ MAX_PREFILL_BLOCK
    with B·width·k ≤ SMALL_KERNEL when width is a multiple of 16 (the small kernel's plain column tiles); else 2,
    decode's block, one fixed shape (narrow or ragged columns take the kernel's tail paths, whose bits depend on
    the row count; so does a slab too large for the small kernel)."""
    b = 2
    while width % 16 == 0 and b < MAX_PREFILL_BLOCK and 2 * b * width * k <= SMALL_KERNEL:
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

    Layout: with row block B = 1, W row-major [out, in] (one GEMV per row reads it); with B = 2, Wᵀ as column
    slabs, each row-major [in, stop - start] (the GEMM's operand, no transpose flag; ``slabs`` lists the bounds) and
    ``weight`` is their [out, in] view (a copy when there are several slabs). C-contiguous float32, one copy.
    Reference: float64 x · Wᵀ; float32 result within ~1e-6 relative (fp32 accumulation).
    """

    def __init__(self, weight: F32Array, name: str = "<linear>") -> None:
        """Args: weight [out, in] float32; name used in error messages. Raises ValueError if not 2-D float32."""
        if weight.ndim != 2 or weight.dtype != np.float32:
            raise ValueError(f"{name}: weight must be 2-D float32, got {list(weight.shape)} {weight.dtype}")
        self.name = name
        self.shape: tuple[int, int] = (int(weight.shape[0]), int(weight.shape[1]))
        self.row_block: int = row_block(self.shape)
        self._w: F32Array = np.ascontiguousarray(weight) if self.row_block == 1 else np.empty((0, 0), np.float32)
        self.slabs: list[tuple[int, int]] = [] if self.row_block == 1 else slab_bounds(self.shape)
        self._slab_w: list[F32Array] = [np.ascontiguousarray(weight[a:b].T) for a, b in self.slabs]  # [in, b - a]
        self._blocks: list[int] = [prefill_block(b - a, self.shape[1]) for a, b in self.slabs]
        self.bytes_per_use: int = int(self._w.nbytes) + sum(int(w.nbytes) for w in self._slab_w)
        self._row = np.empty(self.shape[1], dtype=np.float32)
        self._pad = np.zeros((2, self.shape[1]), dtype=np.float32)  # a lone row and a zero row
        self._pad_out = np.empty((2, self.shape[0]), dtype=np.float32)

    @property
    def weight(self) -> F32Array:
        """W [out, in] float32 (a transposed view of the one slab, or a copy joining several)."""
        if self.row_block == 1:
            return self._w
        if len(self._slab_w) == 1:
            return self._slab_w[0].T
        return np.ascontiguousarray(np.concatenate(self._slab_w, axis=1).T)

    def matmul(self, x: F32Array) -> F32Array:
        """y = x · Wᵀ by one GEMV per row (row block 1) or by slabs and row blocks (module docstring), so row i's
        bits depend on x[i] only.

        Args: x [T, in] float32. Returns: [T, out] float32. Raises: ValueError on a wrong shape/dtype.
        """
        _check_x(x, self.shape, self.name)
        t = x.shape[0]
        out = np.empty((t, self.shape[0]), dtype=np.float32)
        if self.row_block == 1:
            row = self._row
            for i in range(t):
                # Copy into one fixed buffer so alignment (which some BLAS kernels branch on) never varies.
                row[...] = x[i]
                np.dot(self._w, row, out=out[i])
            return out
        self._rows(np.ascontiguousarray(x), out)
        return out

    def _rows(self, x: F32Array, out: F32Array) -> None:
        """out[:, a:b] = x · Wᵀ[:, a:b] for every slab: full blocks of the slab's ``prefill_block`` rows in one
        stacked call, then the remaining rows as one block (a single row padded with a zero row)."""
        t, k = x.shape
        for (a, b), w, block in zip(self.slabs, self._slab_w, self._blocks):
            full = t // block * block
            if full:  # out[:full] is C-contiguous: its [blocks, block, out] reshape is a view
                blocks = out[:full].reshape(full // block, block, self.shape[0])[:, :, a:b]
                np.matmul(x[:full].reshape(full // block, block, k), w, out=blocks)
            if t - full == 1:
                self._pad[0] = x[full]
                np.matmul(self._pad, w, out=self._pad_out[:, a:b])
                out[full, a:b] = self._pad_out[0, a:b]
            elif full < t:
                out[full:, a:b] = np.matmul(x[full:], w)


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
