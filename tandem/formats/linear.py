"""Linear weights: every matrix the model multiplies by, whatever its storage format (DESIGN.md layer 3).

A `Linear` holds W with shape [out, in] (PyTorch convention) and computes y = x · Wᵀ in float32.
Weights are converted exactly to float32 at load (spec/qwen3_5.md §9 for FP8 block scales).

Row invariance (DESIGN.md, "matrix rows"): `matmul` gives row i the same bits whatever the other rows are and
however many there are, on every BLAS and every kernel the BLAS picks for the host CPU, so prefill (many rows),
decode (one) and verify (a tree's nodes) agree bit for bit. Every row is one call of the same GEMV, y = W · x with
W row-major [out, in], with x copied into one fixed buffer and y written into another: the same routine, shape,
strides, alignment and thread count for every row of every call. A BLAS routine's arithmetic depends on those and on
the host's kernel, never on the values, so a row's bits are a function of the row alone. A GEMM of several rows
would not do: OpenBLAS forwards one row to GEMV and picks among kernels (small-matrix, blocked, their tails, the
threading split) by the row count and the host's core type, and a row's bits change with each choice
(tests/test_prefill_rows.py shows it for the BLAS in use; tests/test_row_invariance_cores.py runs the row checks
under several forced OpenBLAS core types).
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from tandem.checkpoint import CheckpointError
from tandem.dtypes import e4m3_to_f32

F32Array = npt.NDArray[np.float32]

FP8_BLOCK = 128


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

    Layout: W row-major [out, in] (``weight``), C-contiguous float32, one copy; each row of x is one GEMV over it
    (module docstring). Reference: float64 x · Wᵀ; float32 result within ~1e-6 relative (fp32 accumulation).
    """

    def __init__(self, weight: F32Array, name: str = "<linear>") -> None:
        """Args: weight [out, in] float32; name used in error messages. Raises ValueError if not 2-D float32."""
        if weight.ndim != 2 or weight.dtype != np.float32:
            raise ValueError(f"{name}: weight must be 2-D float32, got {list(weight.shape)} {weight.dtype}")
        self.name = name
        self.shape: tuple[int, int] = (int(weight.shape[0]), int(weight.shape[1]))
        self.weight: F32Array = np.ascontiguousarray(weight)
        self.bytes_per_use: int = int(self.weight.nbytes)
        self._local = threading.local()  # each thread's fixed GEMV buffers (x row, y row)

    def _buffers(self) -> tuple[F32Array, F32Array]:
        """This thread's GEMV operands: x [in] and y [out] float32, made once and reused for every row."""
        found: tuple[F32Array, F32Array] | None = getattr(self._local, "rows", None)
        if found is None:
            found = self._local.rows = (np.empty(self.shape[1], np.float32), np.empty(self.shape[0], np.float32))
        return found

    def matmul(self, x: F32Array) -> F32Array:
        """y = x · Wᵀ by one GEMV per row from fixed buffers (module docstring), so row i's bits depend on x[i]
        only, on every BLAS kernel.

        Args: x [T, in] float32. Returns: [T, out] float32. Raises: ValueError on a wrong shape/dtype.
        """
        _check_x(x, self.shape, self.name)
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        row, y = self._buffers()
        w = self.weight
        for i in range(x.shape[0]):
            row[...] = x[i]
            np.dot(w, row, out=y)
            out[i] = y
        return out


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
