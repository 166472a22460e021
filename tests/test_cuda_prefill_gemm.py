"""The prefill's bf16 weights and GEMMs (cuda/prefill_gemm.cu, tandem/backend/cuda/prefill_gemm.py), on fresh
random inputs.

Checks: every device Linear (BF16, FP8 block-scaled, NVFP4 in both scale conventions; tile-major and row-major
storage; concatenated and glu_pair Linears; the fp32 fallback) dequantised to bf16 equals its NumPy twin
``reference_bf16_weight`` bit for bit, every element written (a NaN-poisoned output); ``gemm_b16`` within 1e-5 of
float64 (``reference_gemm``), deterministic, and row-invariant for calls of at least MIN_ROWS rows (rows of a short
call at an offset equal the same rows of a long call, bit for bit: the chunk-invariance the prefill rests on);
``row_invariant`` holds at the 27B shapes on this device; bad arguments raise ValueError.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import gemv  # noqa: E402
from tandem.backend.cuda.checks import rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.backend.cuda.prefill_gemm import (MIN_ROWS, bf16_weight, gemm_b16, reference_bf16_weight,  # noqa: E402
                                              reference_gemm, row_invariant)
from tandem.backend.cuda.upload import CudaF32Linear  # noqa: E402
from tandem.dtypes import f32_to_bf16  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

FORMATS = ["bf16", "fp8", "nvfp4", "nvfp4_divide"]
SHAPES = [(336, 1024), (48, 5120), (40, 0)]  # tile-major, tile-major, row-major storage (in: ROW_MAJOR_IN)
ROW_MAJOR_IN = {"bf16": 1000, "fp8": 1056, "nvfp4": 1056, "nvfp4_divide": 1056}  # no tile-major path at these
POISON = 0x7FC1  # a bf16 NaN


def _e4m3(rng: np.random.Generator, shape: tuple[int, ...], positive: bool = False) -> np.ndarray:
    codes = rng.integers(0, 127, size=shape, dtype=np.uint8)
    if not positive:
        codes |= (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7).astype(np.uint8)
    return codes


def _linear(fmt: str, out_dim: int, in_dim: int, rng: np.random.Generator) -> Any:
    if fmt == "bf16":
        return gemv.CudaDenseLinear(f32_to_bf16(rng.standard_normal((out_dim, in_dim)).astype(np.float32)))
    if fmt == "fp8":
        scale = (2.0 ** rng.uniform(-10, -2, size=(-(-out_dim // 128), -(-in_dim // 128)))).astype(np.float32)
        return gemv.CudaFP8BlockLinear(_e4m3(rng, (out_dim, in_dim)), scale)
    packed = rng.integers(0, 256, size=(out_dim, in_dim // 2), dtype=np.uint8)
    divide = fmt == "nvfp4_divide"
    g = float(np.float32(rng.uniform(0.5, 2.0) * (1000.0 if divide else 1e-3)))
    return gemv.CudaNVFP4Linear(packed, _e4m3(rng, (out_dim, in_dim // 16), positive=True), g, divide=divide)


def _check(lin: Any) -> None:
    out_dim, in_dim = lin.shape
    buf = cp.full((out_dim * in_dim + 5,), POISON, dtype=cp.uint16)
    got = cp.asnumpy(bf16_weight(lin, out=buf))
    assert got.shape == (out_dim, in_dim)
    np.testing.assert_array_equal(got, reference_bf16_weight(lin))
    assert int(buf[-1]) == POISON  # nothing written past the weight
    again = cp.asnumpy(bf16_weight(lin))
    np.testing.assert_array_equal(again, got)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantised_weight_equals_the_reference(fmt: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(secrets.randbits(32))
    lin = _linear(fmt, shape[0], shape[1] or ROW_MAJOR_IN[fmt], rng)
    assert lin.tiled == bool(shape[1])
    _check(lin)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_fused_linears_dequantise_as_their_parts(fmt: str) -> None:
    """A concat Linear gives its parts' rows one after another; a glu_pair gives [gate; up] de-interleaved."""
    rng = np.random.default_rng(secrets.randbits(32))
    parts = [_linear(fmt, n, 512, rng) for n in (64, 32, 16)]
    fused = gemv.concat(parts)
    _check(fused)
    np.testing.assert_array_equal(cp.asnumpy(bf16_weight(fused)),
                                  np.concatenate([reference_bf16_weight(p) for p in parts]))
    gate, up = _linear(fmt, 48, 512, rng), _linear(fmt, 48, 512, rng)
    pair = gemv.glu_pair(gate, up)
    _check(pair)
    np.testing.assert_array_equal(cp.asnumpy(bf16_weight(pair)),
                                  np.concatenate([reference_bf16_weight(gate), reference_bf16_weight(up)]))


def test_fp32_fallback_weight_rounds_to_bf16() -> None:
    w = np.random.default_rng(secrets.randbits(32)).standard_normal((24, 72)).astype(np.float32)
    _check(CudaF32Linear(w))


def test_gemm_matches_float64_and_is_row_invariant() -> None:
    rng = np.random.default_rng(secrets.randbits(32))
    k, n, total = 1024, 768, 1100
    a = f32_to_bf16(rng.standard_normal((total, k)).astype(np.float32))
    w = f32_to_bf16((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    ad, wd = cp.asarray(a), cp.asarray(w)
    full = gemm_b16(ad, wd, cp.full((total, n), np.nan, dtype=cp.float32))
    got = cp.asnumpy(full)
    assert not np.isnan(got).any()
    assert rel_error(got, reference_gemm(a, w)) < 1e-5
    again = gemm_b16(ad, wd, cp.empty((total, n), dtype=cp.float32))
    assert cp.array_equal(again.view(cp.uint32), full.view(cp.uint32)), "not deterministic"
    for off, rows in ((0, MIN_ROWS), (1, MIN_ROWS), (37, 300), (129, 512), (300, 777)):
        part = gemm_b16(cp.ascontiguousarray(ad[off:off + rows]), wd, cp.empty((rows, n), dtype=cp.float32))
        assert cp.array_equal(part.view(cp.uint32), full[off:off + rows].view(cp.uint32)), (off, rows)


@pytest.mark.parametrize("k,n", [(5120, 16480), (6144, 5120), (5120, 34816), (17408, 5120), (5120, 14336)])
def test_cublas_is_row_invariant_at_the_27b_shapes(k: int, n: int) -> None:
    assert row_invariant(k, n, 4096)


def test_bad_arguments_raise() -> None:
    a = cp.zeros((MIN_ROWS, 64), dtype=cp.uint16)
    with pytest.raises(ValueError):
        gemm_b16(a, cp.zeros((32, 48), dtype=cp.uint16), cp.empty((MIN_ROWS, 32), dtype=cp.float32))
    with pytest.raises(ValueError):
        gemm_b16(a, cp.zeros((32, 64), dtype=cp.uint16), cp.empty((MIN_ROWS, 32), dtype=cp.float64))
    lin = _linear("bf16", 16, 64, np.random.default_rng(0))
    with pytest.raises(ValueError):
        bf16_weight(lin, out=cp.zeros((100,), dtype=cp.uint16))
