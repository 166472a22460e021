"""NVFP4 and per-tensor / per-row FP8 weights (spec/qwen3_5.md §10), dequantized exactly to float32 at load.

NVFP4: W[r, j] = e2m1(nib[r, j]) · f32(weight_scale[r, j // 16]) · weight_scale_2 (ModelOpt), or
`/ weight_global_scale` (compressed-tensors, which stores the global scale as a divisor, §10.2). The first
product (≤ 2 significant bits × 4 bits) is exact in float32; the global scale costs one rounding.
Activations stay float32 (weight-only, W4A16) in the reference.

The quantiser (`quantize_nvfp4`) follows ModelOpt: global = amax(W) / (6 · 448) so every block scale fits E4M3;
per 16-value block s = e4m3(clip · max|w_block| / 6 / global); codes = E2M1 nearest-even of w / (s · global),
saturating at ±6.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.dtypes import E2M1_MAX, E2M1_TABLE, E4M3_MAX, e4m3_to_f32, f32_to_e2m1, f32_to_e4m3, pack_e2m1, unpack_e2m1
from tandem.formats.linear import DenseLinear

F32Array = npt.NDArray[np.float32]
U8Array = npt.NDArray[np.uint8]

NVFP4_GROUP = 16


def dequantize_nvfp4(packed: U8Array, scale_codes: U8Array, global_scale: float, *, divide: bool = False,
                     name: str = "<linear>") -> F32Array:
    """W = e2m1(codes) · f32(scale) · global (or / global with ``divide``, compressed-tensors).

    Args:
        packed: [out, in/2] uint8, two E2M1 codes a byte, low nibble first.
        scale_codes: [out, in/16] uint8, E4M3 block-scale bits.
        global_scale: the fp32 tensor scale (`weight_scale_2`, or `weight_global_scale` with ``divide``).
    Returns:
        [out, in] float32.
    Raises:
        CheckpointError: the scale grid does not match the packed weight (names the tensor).
    """
    out_dim, half = packed.shape
    if scale_codes.shape != (out_dim, 2 * half // NVFP4_GROUP) or (2 * half) % NVFP4_GROUP:
        raise CheckpointError(
            f"{name}.weight_scale has shape {list(scale_codes.shape)}, expected [{out_dim}, "
            f"{2 * half // NVFP4_GROUP}] for packed weight [{out_dim}, {half}] (16 values a block)")
    values = E2M1_TABLE[unpack_e2m1(np.asarray(packed, dtype=np.uint8))]            # [out, in]
    scale = e4m3_to_f32(np.asarray(scale_codes, dtype=np.uint8))                      # [out, in/16]
    w = (values.reshape(out_dim, -1, NVFP4_GROUP) * scale[:, :, None]).reshape(out_dim, -1)  # exact
    g = np.float32(global_scale)
    out: F32Array = (w / g) if divide else (w * g)
    return out.astype(np.float32, copy=False)


def nvfp4_global_scale(w: F32Array) -> np.float32:
    """ModelOpt's tensor scale amax(W) / (6 · 448), so that block scales with clip ≤ 1 fit E4M3 (1.0 if W = 0)."""
    amax = float(np.max(np.abs(w))) if w.size else 0.0
    return np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)


def nvfp4_fake_quant(w: F32Array, clip: F32Array | float, global_scale: np.float32
                     ) -> tuple[F32Array, U8Array, U8Array]:
    """Quantise and dequantise W block by block with clip multipliers of each block's maximum.

    Args:
        w: [out, in] float32, in a multiple of 16.
        clip: scalar or [out, in/16] float32 multipliers of max|w_block| (1.0 = round to nearest).
        global_scale: the fp32 tensor scale.
    Returns:
        (dequantized [out, in] float32, codes [out, in] uint8 (unpacked), scale codes [out, in/16] uint8 E4M3).
    """
    out_dim, in_dim = w.shape
    blocks = w.reshape(out_dim, in_dim // NVFP4_GROUP, NVFP4_GROUP)
    amax = np.max(np.abs(blocks), axis=2)
    target = amax * np.asarray(clip, np.float32) / np.float32(E2M1_MAX) / global_scale   # s, before rounding
    scale_codes = f32_to_e4m3(target.astype(np.float32))
    scale = e4m3_to_f32(scale_codes)                                                  # [out, in/16]
    step = (scale * global_scale)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(step > 0, blocks / step, np.float32(0.0))
    ratio = np.clip(ratio, -E2M1_MAX, E2M1_MAX).astype(np.float32)
    codes = f32_to_e2m1(ratio)
    deq = (E2M1_TABLE[codes] * scale[:, :, None]).reshape(out_dim, in_dim) * global_scale
    return deq.astype(np.float32), codes.reshape(out_dim, in_dim), scale_codes


def quantize_nvfp4(w: F32Array, clip: F32Array | float = 1.0, global_scale: float | None = None,
                   name: str = "<linear>") -> tuple[U8Array, U8Array, np.float32]:
    """Quantise W [out, in] to NVFP4 in the ModelOpt layout.

    Args:
        w: [out, in] float32.
        clip: scalar or [out, in/16] multipliers of each block's maximum (from a clip search; 1.0 = RTN).
        global_scale: fp32 tensor scale; default amax(W) / (6 · 448).
    Returns:
        (weight [out, in/2] uint8 packed, weight_scale [out, in/16] uint8 E4M3 bits, weight_scale_2 float32).
    Raises:
        ValueError: W not 2-D or `in` not a multiple of 16 (names the tensor).
    """
    if w.ndim != 2 or w.shape[1] % NVFP4_GROUP:
        raise ValueError(f"{name}: NVFP4 needs a 2-D weight with `in` a multiple of {NVFP4_GROUP}, "
                         f"got shape {list(w.shape)}")
    g = nvfp4_global_scale(w) if global_scale is None else np.float32(global_scale)
    _, codes, scale_codes = nvfp4_fake_quant(np.asarray(w, dtype=np.float32), clip, g)
    return pack_e2m1(codes), scale_codes, g


class NVFP4Linear(DenseLinear):
    """NVFP4 weight (E2M1 codes, E4M3 scale per 16 values of a row, fp32 tensor scale), float32 at load.

    Layout: W row-major [out, in] float32 (dequantized; `matmul` is DenseLinear's row-invariant GEMV per row);
    `stored_bytes` is codes + block scales + tensor scale as stored (0.5625 bytes a weight + 4).
    Reference: float64 e2m1(nib) · e4m3(scale) · global (spec §10.1); exact up to the one global rounding.
    """

    def __init__(self, packed: U8Array, scale_codes: U8Array, global_scale: float, *, divide: bool = False,
                 name: str = "<linear>") -> None:
        """Args: packed [out, in/2] uint8; scale_codes [out, in/16] uint8 (E4M3 bits); global_scale fp32;
        divide for compressed-tensors' divisor convention. Raises CheckpointError on a scale-grid mismatch."""
        super().__init__(dequantize_nvfp4(packed, scale_codes, global_scale, divide=divide, name=name), name)
        self.stored_bytes: int = int(packed.nbytes) + int(scale_codes.nbytes) + 4


class FP8ScaledLinear(DenseLinear):
    """FP8 E4M3 weight with a per-tensor (scalar) or per-row ([out] / [out, 1]) fp32 scale, float32 at load.

    ModelOpt MIXED_PRECISION stores attention/GDN projections per tensor (`weight_scale` scalar, spec §10.1);
    Tandem's quantiser writes an FP8 head with per-row scales [out, 1]. W[r, j] = f32(Wq[r, j]) · scale[r].
    Layout: W row-major [out, in] float32. Reference: float64 product; one float32 rounding.
    """

    def __init__(self, codes: U8Array, scale: F32Array, name: str = "<linear>") -> None:
        """Args: codes [out, in] uint8 (E4M3 bits); scale of size 1 or out, float32.
        Raises CheckpointError for a scale of another size."""
        out_dim = codes.shape[0]
        flat = np.asarray(scale, dtype=np.float32).reshape(-1)
        if flat.size not in (1, out_dim):
            raise CheckpointError(f"{name}.weight_scale has shape {list(scale.shape)}; expected a scalar "
                                  f"(per tensor) or [{out_dim}] / [{out_dim}, 1] (per row)")
        super().__init__((e4m3_to_f32(codes) * flat.reshape(-1, 1)).astype(np.float32), name)
        self.stored_bytes: int = int(codes.nbytes) + int(flat.nbytes)


def quantize_fp8_rows(w: F32Array, clip: F32Array | float = 1.0) -> tuple[U8Array, F32Array]:
    """Per-row FP8: scale[r] = clip · max|W[r]| / 448, codes = e4m3(W / scale). Returns (codes, scale [out, 1])."""
    amax = np.max(np.abs(w), axis=1, keepdims=True) * np.asarray(clip, np.float32)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    return f32_to_e4m3(np.clip(w / scale, -E4M3_MAX, E4M3_MAX).astype(np.float32)), scale


def _scalar(ckpt: Checkpoint, name: str) -> float:
    value = ckpt.get(name)
    if value.size != 1:
        raise CheckpointError(f"{name}: expected a scalar fp32 tensor scale, found shape {list(value.shape)}")
    return float(value.reshape(-1)[0])


def load_nvfp4(ckpt: Checkpoint, name_prefix: str) -> NVFP4Linear:
    """Load a ModelOpt (`weight` + `weight_scale` + `weight_scale_2`) or compressed-tensors (`weight_packed` +
    `weight_scale` + `weight_global_scale`) NVFP4 linear. `input_scale` (W4A4) is ignored: W4A16 reference.

    Raises:
        CheckpointError: a tensor missing, a packed weight not U8, scales not F8_E4M3, or a bad scale grid.
    """
    ct = ckpt.has(f"{name_prefix}.weight_packed")
    weight_name = f"{name_prefix}.weight_packed" if ct else f"{name_prefix}.weight"
    scale_name = f"{name_prefix}.weight_scale"
    global_name = f"{name_prefix}.weight_global_scale" if ct else f"{name_prefix}.weight_scale_2"
    if ckpt.dtype(weight_name) not in ("U8", "I8"):
        raise CheckpointError(f"{weight_name}: NVFP4 codes must be U8 (two per byte), found {ckpt.dtype(weight_name)}")
    if ckpt.dtype(scale_name) != "F8_E4M3":
        raise CheckpointError(f"{scale_name}: NVFP4 block scales must be F8_E4M3, found {ckpt.dtype(scale_name)}")
    packed = np.asarray(ckpt.raw(weight_name)).view(np.uint8)
    if packed.ndim != 2:
        raise CheckpointError(f"{weight_name}: packed NVFP4 weight must be 2-D, found {list(packed.shape)}")
    scale_codes = np.asarray(ckpt.raw(scale_name), dtype=np.uint8)
    return NVFP4Linear(packed, scale_codes, _scalar(ckpt, global_name), divide=ct, name=name_prefix)


def is_nvfp4(ckpt: Checkpoint, name_prefix: str) -> bool:
    """Whether `name_prefix` is stored as NVFP4 (ModelOpt or compressed-tensors tensor names)."""
    return ckpt.has(f"{name_prefix}.weight_scale_2") or (
        ckpt.has(f"{name_prefix}.weight_packed") and ckpt.has(f"{name_prefix}.weight_global_scale"))


def load_fp8_scaled(ckpt: Checkpoint, name_prefix: str) -> FP8ScaledLinear:
    """Load `weight` (F8_E4M3) with a scalar or per-row fp32 `weight_scale`. Raises CheckpointError."""
    weight_name, scale_name = f"{name_prefix}.weight", f"{name_prefix}.weight_scale"
    if ckpt.dtype(weight_name) != "F8_E4M3":
        raise CheckpointError(f"{weight_name}: has {scale_name} but dtype {ckpt.dtype(weight_name)!r}, "
                              "expected 'F8_E4M3' (or U8 NVFP4 with weight_scale_2)")
    return FP8ScaledLinear(np.asarray(ckpt.raw(weight_name), dtype=np.uint8), ckpt.get(scale_name), name_prefix)
