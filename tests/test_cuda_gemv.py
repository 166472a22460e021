"""CUDA GEMV / skinny GEMM (cuda/gemv.cu, v2 tensor-core and v1 CUDA-core paths) vs the host formats'
dequantization, on fresh random inputs.

Checks: relative error vs float64 (≤ 1e-5, fp32 accumulation), every output element written (NaN-poisoned
output), row invariance (row i bitwise equal for T = 1 and for every T up to 64), ValueError on bad arguments.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import gemv  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import f32_to_bf16  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

FORMATS = ["bf16", "fp8", "nvfp4", "nvfp4_divide"]
SHAPES = [(333, 1024), (2048, 4096), (48, 5120)]  # v2 (tensor cores) takes all three
V1_IN = {"bf16": 1000, "fp8": 1008, "nvfp4": 1056, "nvfp4_divide": 1056}  # in not a multiple of the v2 chunk
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 9, 17, 32, 64]
TOL = 1e-5


def _finite_e4m3(rng: np.random.Generator, shape: tuple[int, ...], positive: bool = False) -> np.ndarray:
    codes = rng.integers(0, 127, size=shape, dtype=np.uint8)  # 0..126: finite, non-negative
    if not positive:
        codes |= (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7).astype(np.uint8)
    return codes


def _make(fmt: str, out_dim: int, in_dim: int, rng: np.random.Generator) -> tuple[Any, Any]:
    """(device Linear, host reference function of x)."""
    if fmt == "bf16":
        bits = f32_to_bf16(rng.standard_normal((out_dim, in_dim)).astype(np.float32))
        return gemv.CudaDenseLinear(bits), lambda x: gemv.reference_bf16(bits, x)
    if fmt == "fp8":
        codes = _finite_e4m3(rng, (out_dim, in_dim))
        scale = (2.0 ** rng.uniform(-10, -2, size=(-(-out_dim // 128), -(-in_dim // 128)))).astype(np.float32)
        return gemv.CudaFP8BlockLinear(codes, scale), lambda x: gemv.reference_fp8(codes, scale, x)
    packed = rng.integers(0, 256, size=(out_dim, in_dim // 2), dtype=np.uint8)
    scales = _finite_e4m3(rng, (out_dim, in_dim // 16), positive=True)
    divide = fmt == "nvfp4_divide"
    g = float(np.float32(rng.uniform(0.5, 2.0) * (1000.0 if divide else 1e-3)))
    return (gemv.CudaNVFP4Linear(packed, scales, g, divide=divide),
            lambda x: gemv.reference_nvfp4(packed, scales, g, x, divide=divide))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_matches_reference_and_is_row_invariant(fmt: str, shape: tuple[int, int]) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    out_dim, in_dim = shape
    lin, ref = _make(fmt, out_dim, in_dim, rng)
    x_host = rng.standard_normal((max(ROW_COUNTS), in_dim)).astype(np.float32)
    x = cp.asarray(x_host)
    ref_full = ref(x_host)  # float64, row by row independent
    full = None
    worst = 0.0
    for t in sorted(ROW_COUNTS, reverse=True):
        y = cp.full((t, out_dim), np.nan, dtype=cp.float32)
        lin.matmul(x[:t], out=y)
        got = cp.asnumpy(y)
        err, merr = rel_error(got, ref_full[:t]), max_rel_error(got, ref_full[:t])
        worst = max(worst, err, merr)
        assert err <= TOL and merr <= TOL, f"{fmt} {shape} T={t} seed={seed}: rel {err:.3g}, max rel {merr:.3g}"
        if full is None:
            full = got
        assert np.array_equal(got.view(np.uint32), full[:t].view(np.uint32)), \
            f"{fmt} {shape}: rows of T={t} differ in bits from the same rows at T={max(ROW_COUNTS)} (seed={seed})"
    assert full is not None
    for i in rng.choice(max(ROW_COUNTS), size=6, replace=False):
        one = cp.asnumpy(lin.matmul(x[i:i + 1].copy()))
        assert np.array_equal(one.view(np.uint32), full[i:i + 1].view(np.uint32)), \
            f"{fmt} {shape}: row {i} alone differs in bits from row {i} of T={max(ROW_COUNTS)} (seed={seed})"
    record(f"gemv[{fmt},{out_dim}x{in_dim}]", max_rel=worst, row_invariant=True, rows=ROW_COUNTS, seed=seed)


def test_gemv_rejects_bad_arguments() -> None:
    rng = np.random.default_rng()
    lin = gemv.CudaDenseLinear(f32_to_bf16(rng.standard_normal((16, 64)).astype(np.float32)))
    with pytest.raises(ValueError, match="float32"):
        lin.matmul(cp.zeros((1, 64), dtype=cp.float64))
    with pytest.raises(ValueError, match="x"):
        lin.matmul(cp.zeros((1, 32), dtype=cp.float32))
    with pytest.raises(ValueError, match="in % 8"):
        gemv.CudaDenseLinear(np.zeros((4, 12), dtype=np.uint16))
    with pytest.raises(ValueError, match="scale"):
        gemv.CudaFP8BlockLinear(np.zeros((128, 256), np.uint8), np.ones((1, 1), np.float32))
    with pytest.raises(ValueError, match="in % 32"):
        gemv.CudaNVFP4Linear(np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8), 1.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_v1_shapes(fmt: str) -> None:
    """Shapes whose `in` the tensor-core chunk does not divide take the v1 kernel: same checks."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    lin, ref = _make(fmt, 77, V1_IN[fmt], rng)
    assert lin.prep_kind is None
    x_host = rng.standard_normal((9, V1_IN[fmt])).astype(np.float32)
    y = cp.full((9, 77), np.nan, dtype=cp.float32)
    got = cp.asnumpy(lin.matmul(cp.asarray(x_host), out=y))
    assert max_rel_error(got, ref(x_host)) <= TOL, f"{fmt} v1 seed={seed}"
    one = cp.asnumpy(lin.matmul(cp.asarray(x_host[4:5])))
    assert np.array_equal(one.view(np.uint32), got[4:5].view(np.uint32))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gemv_concat_and_shared_prepare(fmt: str) -> None:
    """concat: one launch for several projections of one input, each part's rows bitwise equal to its own GEMV;
    matmul_prepared with one shared xs equals matmul."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    made = [_make(fmt, n, 1024, rng) for n in (256, 48, 48, 130)]
    lins = [m[0] for m in made]
    both = gemv.concat(lins)
    assert both.splits == (256, 48, 48, 130) and both.shape == (482, 1024)
    x = cp.asarray(rng.standard_normal((5, 1024)).astype(np.float32))
    xs = gemv.prepare(x, both.prep_kind)
    y = cp.asnumpy(both.matmul_prepared(xs, out=cp.full((5, 482), np.nan, dtype=cp.float32)))
    start = 0
    for lin, (_, ref) in zip(lins, made):
        n = lin.shape[0]
        own = cp.asnumpy(lin.matmul(x))
        assert max_rel_error(y[:, start:start + n], ref(cp.asnumpy(x))) <= TOL, f"{fmt} seed={seed}"
        assert np.array_equal(own.view(np.uint32), y[:, start:start + n].view(np.uint32)), f"{fmt} seed={seed}"
        start += n


def test_gemv_bf16_any_magnitude() -> None:
    """The BF16 path splits x into three bf16 parts (full fp32 exponent range): huge and tiny x stay exact-ish."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    lin, ref = _make("bf16", 64, 512, rng)
    for scale in (1e-30, 1e-3, 1e5, 1e30):
        x_host = (rng.standard_normal((3, 512)) * scale).astype(np.float32)
        got = cp.asnumpy(lin.matmul(cp.asarray(x_host)))
        assert max_rel_error(got, ref(x_host)) <= TOL, f"scale {scale} seed={seed}"


def test_split_cols() -> None:
    """split_cols: the column pieces of a fused projection's output, bitwise, into NaN-poisoned outputs."""
    rng = np.random.default_rng()
    y = rng.standard_normal((7, 300)).astype(np.float32)
    for col0, n in ((0, 100), (100, 150), (250, 50)):
        out = cp.full((7, n), np.nan, dtype=cp.float32)
        gemv.split_cols(cp.asarray(y), col0, n, out=out)
        assert np.array_equal(cp.asnumpy(out), y[:, col0:col0 + n])
    with pytest.raises(ValueError, match="outside"):
        gemv.split_cols(cp.asarray(y), 250, 51)
