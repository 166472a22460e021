"""Exact conversions between checkpoint storage dtypes and float32, in plain NumPy.

Decoders widen stored bits to float32 exactly (every BF16, F16 and F8_E4M3 value is a float32 value).
Encoders (float32 -> bf16 bits, float32 -> e4m3 bits) round to nearest, ties to even; they are used by
tools that write checkpoints. ml_dtypes is used only in tests, to cross-check.

Source: spec/qwen3_5.md §9 (E4M3FN: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; subnormals when
e = 0; no infinities; S.1111.111 = NaN; max finite 448).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

F32Array = npt.NDArray[np.float32]

E4M3_MAX = 448.0


def _build_e4m3_table() -> F32Array:
    """All 256 E4M3FN codes decoded to float32, from the format definition (spec §9)."""
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> 3) & 0xF
        mantissa = code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[code] = np.nan
        elif exponent == 0:
            table[code] = sign * (mantissa / 8.0) * 2.0**-6
        else:
            table[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    table.setflags(write=False)
    return table


E4M3_TABLE: F32Array = _build_e4m3_table()
# Non-negative finite values, codes 0..126, strictly increasing: the search grid for the encoder.
_E4M3_POSITIVE: F32Array = E4M3_TABLE[:127]


def bf16_to_f32(bits: npt.NDArray[np.uint16]) -> F32Array:
    """Decode bfloat16 bits to float32 exactly (the bits are the top half of a float32).

    Args:
        bits: any shape, uint16 (the stored BF16 bits).
    Returns:
        float32 array of the same shape.
    Raises:
        TypeError: if `bits` is not uint16.
    """
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 expects uint16 bits, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


KV_DTYPES = ("bfloat16", "float32")  # BufferSpec dtype names of KV rows
_KV_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


def kv_dtype_name(name: str) -> str:
    """The BufferSpec dtype name of a KV storage given as "bf16" / "bfloat16" or "fp32" / "float32".

    Raises: ValueError for another name.
    """
    if name not in _KV_ALIASES:
        raise ValueError(f"KV dtype must be 'bf16' or 'fp32', got {name!r}")
    return _KV_ALIASES[name]


def storage_dtype(name: str) -> np.dtype[Any]:
    """The NumPy (and CuPy) dtype that holds a buffer of dtype ``name``: uint16 bits for "bfloat16" (NumPy has no
    bfloat16), else ``np.dtype(name)``. Raises TypeError for a name NumPy does not know."""
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def f16_to_f32(bits: npt.NDArray[np.uint16]) -> F32Array:
    """Decode IEEE half-precision bits (uint16) to float32 exactly. Any shape; raises TypeError on non-uint16."""
    if bits.dtype != np.uint16:
        raise TypeError(f"f16_to_f32 expects uint16 bits, got {bits.dtype}")
    return bits.view(np.float16).astype(np.float32)


def e4m3_to_f32(bits: npt.NDArray[np.uint8]) -> F32Array:
    """Decode float8_e4m3fn codes (uint8) to float32 exactly by a 256-entry table (spec §9).

    Args:
        bits: any shape, uint8. Code 0x7F / 0xFF decode to NaN.
    Returns:
        float32 array of the same shape.
    Raises:
        TypeError: if `bits` is not uint8.
    """
    if bits.dtype != np.uint8:
        raise TypeError(f"e4m3_to_f32 expects uint8 codes, got {bits.dtype}")
    out: F32Array = E4M3_TABLE[bits]
    return out


def f32_to_bf16(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """Round float32 to bfloat16 bits, nearest-even; NaN stays a (quiet) NaN, overflow rounds to ±inf.

    Args:
        x: any shape, float32 (other float dtypes are first cast to float32).
    Returns:
        uint16 bits, same shape.
    """
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        sign = ((bits >> 16) & 0x8000).astype(np.uint16)
        rounded = np.where(nan, sign | np.uint16(0x7FC0), rounded).astype(np.uint16)
    return rounded


def f32_to_e4m3(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """Round float32 to float8_e4m3fn codes: nearest, ties to the even code; saturates at ±448.

    Ties to even: the mantissa LSB is the code LSB, so among two neighbours the even code wins.
    NaN maps to 0x7F (with the sign bit of the input). Source: spec §9.

    Args:
        x: any shape, float32.
    Returns:
        uint8 codes, same shape.
    """
    xf = np.asarray(x, dtype=np.float32)
    mag = np.abs(xf)
    hi = np.searchsorted(_E4M3_POSITIVE, mag, side="left").clip(1, 126)
    lo = hi - 1
    d_lo = mag - _E4M3_POSITIVE[lo]
    d_hi = _E4M3_POSITIVE[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    code = np.where(mag >= E4M3_MAX, 126, code)
    code = np.where(mag == 0, 0, code)
    code = np.where(np.isnan(mag), 127, code).astype(np.uint8)
    sign = (np.signbit(xf).astype(np.uint8) << 7).astype(np.uint8)
    return (code | sign).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------- E2M1 (FP4)
# spec/qwen3_5.md §10.1: nibble bit 3 = sign, bits 2..0 index the magnitudes below (1 sign, 2 exponent bits with
# bias 1, 1 mantissa bit; subnormal 0.5; max 6). Two codes per byte, element 2c in the low nibble.
E2M1_MAX = 6.0
E2M1_TABLE: F32Array = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
E2M1_TABLE.setflags(write=False)
# Rounding thresholds on |x| (spec §10.1, `cast_to_fp4`): ties go to the even code (0, 1, 2, 4 have an even
# mantissa bit), so the boundary belongs to the lower code where that code is even: ≤ 0.25 → 0, < 0.75 → 0.5,
# ≤ 1.25 → 1, < 1.75 → 1.5, ≤ 2.5 → 2, < 3.5 → 3, ≤ 5 → 4, else 6.
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_LOWER_WINS = np.array([True, False, True, False, True, False, True])


def e2m1_to_f32(codes: npt.NDArray[np.uint8]) -> F32Array:
    """Decode E2M1 codes (one per uint8, values 0..15) to float32 exactly by a 16-entry table (spec §10.1).

    Args:
        codes: any shape, uint8 in 0..15.
    Returns:
        float32 array of the same shape.
    Raises:
        TypeError: if `codes` is not uint8. ValueError: a code above 15.
    """
    if codes.dtype != np.uint8:
        raise TypeError(f"e2m1_to_f32 expects uint8 codes, got {codes.dtype}")
    if codes.size and int(codes.max()) > 15:
        raise ValueError(f"E2M1 codes are 4-bit (0..15), found {int(codes.max())}")
    out: F32Array = E2M1_TABLE[codes]
    return out


def f32_to_e2m1(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """Round float32 to E2M1 codes (0..15): nearest on the E2M1 grid, ties to even, saturating at ±6.

    Thresholds of spec §10.1. NaN maps to magnitude 6 with its sign bit (E2M1 has no NaN; callers clamp first).

    Args:
        x: any shape, float32.
    Returns:
        uint8 codes in 0..15, same shape (bit 3 = sign of x, -0.0 keeps its sign).
    """
    xf = np.asarray(x, dtype=np.float32)
    mag = np.abs(xf)
    # Index of the first bound >= mag (side="left"): mag exactly on a bound counts as below it ...
    idx = np.searchsorted(_E2M1_BOUNDS, mag, side="left")
    # ... which is right where the lower code is even; where it is odd the tie goes up.
    on_bound = (idx < 7) & (mag == _E2M1_BOUNDS[np.minimum(idx, 6)])
    idx = idx + (on_bound & ~_E2M1_LOWER_WINS[np.minimum(idx, 6)])
    idx = np.where(np.isnan(mag), 7, idx)
    sign = (np.signbit(xf).astype(np.uint8) << 3).astype(np.uint8)
    return (idx.astype(np.uint8) | sign).astype(np.uint8)


def pack_e2m1(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Pack E2M1 codes two per byte along the last axis: element 2c in the low nibble, 2c+1 in the high nibble.

    Args:
        codes: [..., n] uint8 in 0..15, n even.
    Returns:
        [..., n/2] uint8.
    Raises:
        ValueError: odd last axis.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last axis, got shape {list(codes.shape)}")
    c = codes.astype(np.uint8)
    packed: npt.NDArray[np.uint8] = ((c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)).astype(np.uint8)
    return packed


def unpack_e2m1(packed: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Inverse of `pack_e2m1`: [..., m] uint8 -> [..., 2m] codes (low nibble first). Raises TypeError on non-uint8."""
    if packed.dtype != np.uint8:
        raise TypeError(f"unpack_e2m1 expects uint8 bytes, got {packed.dtype}")
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out
