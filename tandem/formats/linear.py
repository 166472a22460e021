"""Linear weights: every matrix the model multiplies by, whatever its storage format (DESIGN.md layer 3).

A `Linear` holds W with shape [out, in] (PyTorch convention) and computes y = x · Wᵀ in float32.
Weights are converted exactly to float32 at load (spec/qwen3_5.md §9 for FP8 block scales).

Row invariance (DESIGN.md, "matrix rows"): `matmul` gives row i the same bits whether x has 1 row or 32,
because it always runs one GEMV per row (a BLAS GEMV and a GEMM round differently). `matmul_prefill` is a GEMM
and is used only by prefill, which is chunked at absolute positions, so a given chunk always takes the same path
and a restored snapshot continues with the bits of a fresh prefill.
"""

from __future__ import annotations

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
        """y = x · Wᵀ, row-invariant. x: [T, in] float32 -> [T, out] float32."""
        ...

    def matmul_prefill(self, x: F32Array) -> F32Array:
        """y = x · Wᵀ as one GEMM (prefill chunks only). x: [T, in] float32 -> [T, out] float32."""
        ...


def _check_x(x: F32Array, shape: tuple[int, int], label: str) -> None:
    if x.ndim != 2 or x.shape[1] != shape[1] or x.dtype != np.float32:
        raise ValueError(
            f"{label}: x must be [T, {shape[1]}] float32, got {list(x.shape)} {x.dtype}")


class DenseLinear:
    """A float32 weight [out, in], exact widening of BF16/F16/F32 storage.

    Layout: W row-major [out, in], C-contiguous float32.
    Reference: float64 x · Wᵀ; float32 result within ~1e-6 relative (fp32 accumulation).
    """

    def __init__(self, weight: F32Array, name: str = "<linear>") -> None:
        """Args: weight [out, in] float32; name used in error messages. Raises ValueError if not 2-D float32."""
        if weight.ndim != 2 or weight.dtype != np.float32:
            raise ValueError(f"{name}: weight must be 2-D float32, got {list(weight.shape)} {weight.dtype}")
        self.name = name
        self.weight: F32Array = np.ascontiguousarray(weight)
        self.shape: tuple[int, int] = (int(weight.shape[0]), int(weight.shape[1]))
        self.bytes_per_use: int = int(self.weight.nbytes)
        self._row = np.empty(self.shape[1], dtype=np.float32)

    def matmul(self, x: F32Array) -> F32Array:
        """y = x · Wᵀ by one GEMV per row, so row i's bits do not depend on T.

        Args: x [T, in] float32. Returns: [T, out] float32. Raises: ValueError on a wrong shape/dtype.
        """
        _check_x(x, self.shape, self.name)
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        row = self._row
        for i in range(x.shape[0]):
            # Copy into one fixed buffer so alignment (which some BLAS kernels branch on) never varies.
            row[...] = x[i]
            np.dot(self.weight, row, out=out[i])
        return out

    def matmul_prefill(self, x: F32Array) -> F32Array:
        """y = x · Wᵀ as one GEMM; prefill only (not row-invariant against `matmul`).

        Args: x [T, in] float32. Returns: [T, out] float32. Raises: ValueError on a wrong shape/dtype.
        """
        _check_x(x, self.shape, self.name)
        out: F32Array = np.ascontiguousarray(x) @ self.weight.T
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
