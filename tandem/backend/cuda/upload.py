"""Host ``Linear`` → device Linear, once at load: the GPU GEMV of the weight's storage format when it applies.

Which device class (tandem/backend/cuda/gemv.py holds the three GEMVs):
- ``NVFP4Linear`` with in % 32 == 0 → ``CudaNVFP4Linear`` of the checkpoint's packed codes, E4M3 block scales and
  global scale (re-read from the checkpoint by the Linear's name: the host class keeps only the fp32 product);
- ``FP8BlockLinear`` with in % 16 == 0 → ``CudaFP8BlockLinear`` of the E4M3 codes and fp32 128×128 scales
  (re-read likewise);
- any other ``DenseLinear`` whose fp32 values are all exactly BF16 (the low 16 bits zero: a BF16 checkpoint, or a
  quantised weight whose products happen to fit) with in % 8 == 0 → ``CudaDenseLinear`` of those BF16 bits;
- everything else (F32/F16 storage, FP8 per-tensor / per-row scales, a shape the GEMV refuses, a Linear built
  without a checkpoint) → ``CudaF32Linear``: the host's fp32 weight as is. Chosen over a BF16 rounding because
  it keeps the weight's exact values (parity with the NumPy reference); it reads 2-8× the bytes, so it is the
  slow path and only meets unusual shapes or formats.
Every device Linear computes the same W as the host Linear (the dequantized product is exact in fp32, spec §9,
§10), so only the accumulation order differs from the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import out_or_new, require
from tandem.backend.cuda.gemv import CudaDenseLinear, CudaFP8BlockLinear, CudaNVFP4Linear
from tandem.backend.cuda.loader import cupy
from tandem.checkpoint import Checkpoint
from tandem.formats import DenseLinear, FP8BlockLinear, Linear, NVFP4Linear


class CudaF32Linear:
    """A float32 weight W [out, in] on the device; y = x · Wᵀ by one cuBLAS GEMV per row (row-invariant: every
    call has the same shape, through one fixed row buffer, whatever T is).

    Layout: row-major [out, in] float32. Reference: float64 x · Wᵀ; relative error ~1e-6.
    """

    def __init__(self, weight: Any) -> None:
        """Args: weight [out, in] float32, NumPy or CuPy (a device array is used without a copy).
        Raises ValueError on a bad dtype / shape."""
        cp = cupy()
        self.weight = cp.ascontiguousarray(cp.asarray(weight))
        require("weight", self.weight, np.float32, (None, None))
        self.shape = (int(self.weight.shape[0]), int(self.weight.shape[1]))
        self.bytes_per_use = int(self.weight.nbytes)
        self._row = cp.empty((self.shape[1],), dtype=cp.float32)

    def matmul(self, x: Any, out: Any = None) -> Any:
        """y = x · Wᵀ. Args: x [T, in] float32 (device). Returns [T, out] float32. Raises ValueError."""
        require("x", x, np.float32, (None, self.shape[1]), contiguous=False)
        cp = cupy()
        y = out_or_new("out", out, (int(x.shape[0]), self.shape[0]))
        for t in range(int(x.shape[0])):
            self._row[...] = x[t]
            cp.dot(self.weight, self._row, out=y[t])
        return y


def bf16_bits(weight: np.ndarray) -> np.ndarray | None:
    """The BF16 bits [out, in] uint16 of a float32 array if every value is exactly BF16, else None."""
    u32 = np.ascontiguousarray(weight, dtype=np.float32).view(np.uint32)
    if np.any(u32 & np.uint32(0xFFFF)):
        return None
    bits: np.ndarray = (u32 >> np.uint32(16)).astype(np.uint16)
    return bits


def _nvfp4(ckpt: Checkpoint, name: str) -> CudaNVFP4Linear:
    ct = ckpt.has(f"{name}.weight_packed")
    packed = np.asarray(ckpt.raw(f"{name}.weight_packed" if ct else f"{name}.weight")).view(np.uint8)
    scale_codes = np.asarray(ckpt.raw(f"{name}.weight_scale"), dtype=np.uint8)
    g = ckpt.get(f"{name}.weight_global_scale" if ct else f"{name}.weight_scale_2")
    return CudaNVFP4Linear(packed, scale_codes, float(g.reshape(-1)[0]), divide=ct)


def _fp8_block(ckpt: Checkpoint, name: str) -> CudaFP8BlockLinear:
    codes = np.asarray(ckpt.raw(f"{name}.weight"), dtype=np.uint8)
    return CudaFP8BlockLinear(codes, ckpt.get(f"{name}.weight_scale_inv").astype(np.float32))


def to_device_linear(lin: Linear, ckpt: Checkpoint | None) -> Any:
    """The device Linear for ``lin`` (see the module docstring for the choice).

    Args: lin: a host Linear (``DenseLinear`` or a subclass). ckpt: the open checkpoint it was loaded from
    (None: quantised formats fall back to their fp32 weight).
    Returns: a device Linear with ``shape``, ``bytes_per_use`` and ``matmul(x [T, in] f32 device)``.
    Raises: ValueError for a Linear of an unknown class (it has no weight to upload).
    """
    if not isinstance(lin, DenseLinear):
        raise ValueError(f"no device upload for {type(lin).__name__} (a DenseLinear subclass is expected)")
    in_dim = lin.shape[1]
    try:  # a GEMV refuses a shape it cannot take with ValueError: then the fp32 fallback
        if ckpt is not None and isinstance(lin, NVFP4Linear) and in_dim % 32 == 0:
            return _nvfp4(ckpt, lin.name)
        if ckpt is not None and isinstance(lin, FP8BlockLinear) and in_dim % 16 == 0:
            return _fp8_block(ckpt, lin.name)
        bits = bf16_bits(lin.weight) if in_dim % 8 == 0 else None
        if bits is not None:
            return CudaDenseLinear(bits)
    except ValueError:
        pass
    return CudaF32Linear(lin.weight)
