"""Exact conversions between checkpoint storage dtypes and float32, in plain NumPy.

Decoders widen stored bits to float32 exactly (every BF16, F16 and F8_E4M3 value is a float32 value).
Encoders (float32 -> bf16 bits, float32 -> e4m3 bits) round to nearest, ties to even; they are used by
tools that write checkpoints. ml_dtypes is used only in tests, to cross-check.

Source: spec/qwen3_5.md §9 (E4M3FN: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; subnormals when
e = 0; no infinities; S.1111.111 = NaN; max finite 448).
"""

from __future__ import annotations

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
