"""The weight layouts the tensor-core GEMV kernels read (cuda/gemv.cu gemv_mma and its verify variants), and their
inverses: tile-major weight codes (``_tile`` / ``_untile``), tile-major NVFP4 scale codes (``_tile_scales`` /
``_untile_scales``) and the NVFP4 pair layout of E2M1 nibbles (``_pair_layout`` / ``_pair_unlayout``;
``e2m1_pair_bits`` is the kernel's decode in NumPy). Pure data movement: no arithmetic, so exact.
Tests: tests/test_gemv_pair_layout.py (CPU), tests/test_cuda_gemv.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.loader import cupy


def _tile(rows: Any) -> Any:
    """Weight codes rows [out, R] (any dtype; R bytes a row, a multiple of 64) -> the tile-major layout the
    tensor-core kernels read (cuda/gemv.cu gemv_mma): uint8 [ceil(out/16) · 16 · R], the 16-row tile t, chunk q (64
    bytes of each row) at byte (t · R/64 + q) · 1024, rows 0-7 then 8-15, lane (g, c)'s 16 bytes at (4 g + c) · 16.
    Rows past ``out`` are zero. One kilobyte per warp and chunk keeps a warp's loads contiguous (faster than
    row-major: docs/performance.md)."""
    cp = cupy()
    out_dim = int(rows.shape[0])
    flat = rows.view(cp.uint8).reshape(out_dim, -1)
    row_bytes = int(flat.shape[1])
    tiles = -(-out_dim // 16)
    padded = cp.zeros((tiles * 16, row_bytes), dtype=cp.uint8)
    padded[:out_dim] = flat
    t = padded.reshape(tiles, 2, 8, row_bytes // 64, 4, 16).transpose(0, 3, 1, 2, 4, 5)
    return cp.ascontiguousarray(t).reshape(-1)


def _tile_scales(codes: Any) -> Any:
    """NVFP4 scale codes [out, in/16] uint8 (in % 128 == 0) -> the tile-major layout the tensor-core kernels read
    (cuda/gemv.cu load_chunk, the staged and warpgroup copies): uint8 [ceil(out/16) · in/128 · 128], the 16-row tile
    t, chunk q (the 8 codes of each row for k in 128 q .. 128 q + 127) at byte (t · in/128 + q) · 128, row r of the
    tile at 8 r. Rows past ``out`` are zero. A warp's scale load is then 64 contiguous bytes (rows g) and 64 more
    (rows g + 8) instead of 8 pieces of 8 bytes each, the warpgroup kernel's copy 128 contiguous bytes instead of 16
    pieces. NumPy or CuPy in, the same out. Raises ValueError unless in/16 % 8 == 0."""
    xp = np if isinstance(codes, np.ndarray) else cupy()
    out_dim, cols = (int(n) for n in codes.shape)
    if cols % 8:
        raise ValueError(f"tile-major NVFP4 scales need in % 128 == 0, got {cols} groups a row")
    tiles = -(-out_dim // 16)
    padded = xp.zeros((tiles * 16, cols), dtype=xp.uint8)
    padded[:out_dim] = codes
    t = padded.reshape(tiles, 16, cols // 8, 8).transpose(0, 2, 1, 3)
    return xp.ascontiguousarray(t).reshape(-1)


def _untile_scales(tiled: Any, out_dim: int, cols: int) -> Any:
    """The inverse of ``_tile_scales``: scale codes [out, cols] uint8, row-major (a new array; NumPy or CuPy)."""
    xp = np if isinstance(tiled, np.ndarray) else cupy()
    tiles = -(-out_dim // 16)
    t = tiled.reshape(tiles, cols // 8, 16, 8).transpose(0, 2, 1, 3)
    return xp.array(t, order="C").reshape(tiles * 16, cols)[:out_dim]  # always a copy (in = 128: t is contiguous)


# NVFP4 pair layout (cuda/gemv.cu e2m1_pair): (magnitude bit, sign bit) of pair k's element in each 16-bit half of a
# 32-bit word; pair k is the checkpoint word's nibbles k (low half) and k + 4 (high half).
PAIR_SLOTS = ((9, 15), (6, 12), (0, 13), (3, 14))


def _pair_layout(words: Any) -> Any:
    """NVFP4 words (uint32, NumPy or CuPy, any shape; nibble j = element j, E2M1 with bit 3 the sign, as the
    checkpoint packs them low nibble first) -> the same elements in the pair layout the tensor-core kernels decode
    (``PAIR_SLOTS``; e2m1_pair: 11 integer instructions a word instead of 15). A new array."""
    out = words & 0
    for k, (mag, sign) in enumerate(PAIR_SLOTS):
        for half in (0, 1):
            src = 4 * (k + 4 * half)
            out |= ((words >> src) & 7) << (mag + 16 * half)
            out |= ((words >> (src + 3)) & 1) << (sign + 16 * half)
    return out


def _pair_unlayout(words: Any) -> Any:
    """The inverse of ``_pair_layout``: words with nibble j = element j again (a new array)."""
    out = words & 0
    for k, (mag, sign) in enumerate(PAIR_SLOTS):
        for half in (0, 1):
            dst = 4 * (k + 4 * half)
            out |= ((words >> (mag + 16 * half)) & 7) << dst
            out |= ((words >> (sign + 16 * half)) & 1) << (dst + 3)
    return out


def e2m1_pair_bits(words: np.ndarray, k: int) -> np.ndarray:
    """NumPy twin of cuda/gemv.cu e2m1_pair: pair k (0..3) of pair-layout words uint32 -> fp16x2 bits uint32 (low
    half: nibble k, high: nibble k + 4) of e2m1 · 2^-14, exact. Raises ValueError on k outside 0..3."""
    w = np.asarray(words, dtype=np.uint32)
    mag, sign = np.uint32(0x0E000E00), np.uint32(0x80008000)
    if k == 0:
        return w & (mag | sign)
    if k == 1:
        return (w << np.uint32(3)) & (mag | sign)
    if k == 2:
        return ((w << np.uint32(9)) & mag) | ((w << np.uint32(2)) & sign)
    if k == 3:
        return ((w << np.uint32(6)) & mag) | ((w << np.uint32(1)) & sign)
    raise ValueError(f"pair index {k}: expected 0..3")


def _untile(tiled: Any, out_dim: int, row_bytes: int, dtype: Any) -> Any:
    """The inverse of ``_tile``: row-major [out, row_bytes / itemsize] of ``dtype`` (a new array)."""
    cp = cupy()
    tiles = -(-out_dim // 16)
    t = tiled.reshape(tiles, row_bytes // 64, 2, 8, 4, 16).transpose(0, 2, 3, 1, 4, 5)
    flat = cp.ascontiguousarray(t).reshape(tiles * 16, row_bytes)[:out_dim]
    return cp.ascontiguousarray(flat).view(dtype)
