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


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_weights_are_stored_tile_major(fmt: str) -> None:
    """Tensor-core Linears keep their codes tile-major (gemv._tile: 1 KB a 16-row tile and chunk, rows padded to
    16), NVFP4 words first put in the pair layout (gemv._pair_layout); rows() gives back the checkpoint's row-major
    codes exactly; shapes without a tensor-core path keep the rows as given."""
    rng = np.random.default_rng(7)
    lin, _ = _make(fmt, 333, 1024, rng)
    assert lin.tiled and lin.paired == (fmt == "nvfp4")
    rows = lin.rows()
    assert rows.shape[0] == 333 and rows.flags.c_contiguous
    stored = {"bf16": "bits", "fp8": "codes", "nvfp4": "packed"}[fmt]
    row_bytes = int(rows.nbytes) // 333
    assert getattr(lin, stored).nbytes == 21 * 16 * row_bytes  # 333 rows padded to 336
    assert cp.array_equal(gemv._untile(gemv._tile(rows), 333, row_bytes, rows.dtype), rows)
    flat = cp.asnumpy(getattr(lin, stored)).view(np.uint8)
    host_rows = cp.asnumpy(rows).view(np.uint8).reshape(333, -1)
    if fmt == "nvfp4":
        host_rows = gemv._pair_layout(host_rows.view(np.uint32)).view(np.uint8)
        packed = rng.integers(0, 256, size=(40, 512), dtype=np.uint8)
        again = gemv.CudaNVFP4Linear(packed, _finite_e4m3(rng, (40, 64), positive=True), 1.0)
        assert np.array_equal(cp.asnumpy(again.rows()), packed)
    # tile 1, chunk 2, lane g = 3, c = 1: row 16 + 3, bytes 2 · 64 + 16 .. +16; the row 8 below it 512 bytes on
    base = (1 * (row_bytes // 64) + 2) * 1024 + (4 * 3 + 1) * 16
    assert np.array_equal(flat[base:base + 16], host_rows[19, 144:160])
    assert np.array_equal(flat[base + 512:base + 528], host_rows[27, 144:160])
    v1, _ = _make(fmt, 40, V1_IN[fmt], rng)
    assert not v1.tiled and not v1.paired


def test_split_cols() -> None:
    """split_cols / split_pieces: the column pieces of a fused projection's output (one launch for up to 4), bitwise,
    into NaN-poisoned outputs; ValueError on columns outside y or a bad piece list."""
    rng = np.random.default_rng()
    y = rng.standard_normal((7, 300)).astype(np.float32)
    for col0, n in ((0, 100), (100, 150), (250, 50)):
        out = cp.full((7, n), np.nan, dtype=cp.float32)
        gemv.split_cols(cp.asarray(y), col0, n, out=out)
        assert np.array_equal(cp.asnumpy(out), y[:, col0:col0 + n])
    with pytest.raises(ValueError, match="outside"):
        gemv.split_cols(cp.asarray(y), 250, 51)
    for sizes in ((300,), (100, 200), (7, 93, 150, 50), (1, 1, 1)):
        outs = [cp.full((7, n), np.nan, dtype=cp.float32) for n in sizes]
        got = gemv.split_pieces(cp.asarray(y), sizes, outs)
        start = 0
        for k, n in enumerate(sizes):
            assert got[k] is outs[k] and np.array_equal(cp.asnumpy(outs[k]), y[:, start:start + n]), (sizes, k)
            start += n
    fresh = gemv.split_pieces(cp.asarray(y), (10, 20), col0=5)
    assert np.array_equal(cp.asnumpy(fresh[1]), y[:, 15:35])
    for bad in ((), (100, 0), (50, 50, 50, 50, 50)):
        with pytest.raises(ValueError, match="pieces"):
            gemv.split_pieces(cp.asarray(y), bad)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gemv_variants_have_the_default_bits(fmt: str) -> None:
    """The tuning variants (chunks in flight, prefetching) change the schedule, never the arithmetic."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    lin, ref = _make(fmt, 333, 2048, rng)
    x = cp.asarray(rng.standard_normal((1, 2048)).astype(np.float32))
    xs = gemv.prepare(x, lin.prep_kind)
    base = cp.asnumpy(lin.matmul_prepared(xs))
    assert max_rel_error(base, ref(cp.asnumpy(x))) <= TOL
    for variant in ("_u2", "_u4", "_u8", "_pf"):
        got = cp.asnumpy(lin.matmul_prepared(xs, out=cp.full((1, 333), np.nan, dtype=cp.float32), variant=variant))
        assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), f"{fmt}{variant} seed={seed}"


def _verify_case(fmt: str, out_dim: int, in_dim: int, rng: np.random.Generator, rows: int = 32) -> tuple[Any, ...]:
    """A Linear, a glu_pair of the same shape, xs of ``rows`` random rows, and every row computed alone (T = 1, the
    decode kernel) by both, checked against the float64 reference."""
    lin, ref = _make(fmt, out_dim, in_dim, rng)
    pair = gemv.glu_pair(_make(fmt, out_dim // 2, in_dim, rng)[0], _make(fmt, out_dim // 2, in_dim, rng)[0])
    x_host = rng.standard_normal((rows, in_dim)).astype(np.float32)
    xs = gemv.prepare(cp.asarray(x_host), lin.prep_kind)
    alone = np.concatenate([cp.asnumpy(lin.matmul_prepared(xs[t:t + 1])) for t in range(rows)])
    alone_glu = np.concatenate([cp.asnumpy(pair.matmul_prepared(xs[t:t + 1])) for t in range(rows)])
    assert max_rel_error(alone, ref(x_host)) <= TOL
    return lin, pair, xs, alone, alone_glu


def _assert_rows_alone(case: tuple[Any, ...], variant: str, rows: int, label: str) -> None:
    """The first ``rows`` rows of the case through ``variant`` (fp32 and glu, NaN-poisoned outputs) have the bits of
    each row computed alone."""
    lin, pair, xs, alone, alone_glu = case
    y = cp.full((rows, lin.shape[0]), np.nan, dtype=cp.float32)
    got = cp.asnumpy(lin.matmul_prepared(xs[:rows], out=y, variant=variant))
    assert np.array_equal(got.view(np.uint32), alone[:rows].view(np.uint32)), f"{label}{variant} rows={rows}"
    yg = cp.full((rows, pair.glu), np.nan, dtype=cp.float32)
    got = cp.asnumpy(pair.matmul_prepared(xs[:rows], out=yg, variant=variant))
    assert np.array_equal(got.view(np.uint32), alone_glu[:rows].view(np.uint32)), f"{label}{variant}_glu rows={rows}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_wide_verify_kernels_have_the_decode_bits(fmt: str) -> None:
    """gemv_mma_wide (every "_w<MT>n<NTB>" variant, fp32 and the glu epilogue, each split kind): every row has the
    bits of that row computed alone (T = 1, the decode kernel), for one row and for row counts that leave partial row
    and column tiles (out = 336: the last 32 / 64-row block is partial); the output is NaN-poisoned first."""
    seed = secrets.randbits(32)
    case = _verify_case(fmt, 336, 1024, np.random.default_rng(seed))
    lin, pair, xs, _, alone_glu = case
    for variant in gemv.WIDE_VARIANTS:
        for rows in (1, 3, 8, 13, 32):
            _assert_rows_alone(case, variant, rows, f"{fmt} seed={seed} ")
            for split in ("f16", "f16p", "bf16"):
                want = gemv.prepare(cp.asarray(alone_glu[:rows]), split)
                got_xs = pair.matmul_prepared(xs[:rows], variant=variant, split=split)
                assert cp.array_equal(got_xs, want), f"{fmt}{variant}_glu split {split} rows={rows} seed={seed}"
    with pytest.raises(ValueError, match="unknown wide"):
        lin.matmul_prepared(xs[:8], variant="_w3n3")


@pytest.mark.parametrize("sms", [0, 1])
@pytest.mark.parametrize("in_dim", [512, 2688])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_staged_verify_kernels_have_the_decode_bits(fmt: str, in_dim: int, sms: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """gemv_mma_staged (every "_p<MT>n<NTB>s<S>" variant of the format, fp32 and the glu epilogue): every row has the
    bits of that row computed alone (the decode kernel). in = 2688 gives each warp several chunks (the stage ring
    wraps; 21 NVFP4 chunks, so warps end on different rounds; FP8 crosses 21 block-scale columns), in = 512 leaves
    NVFP4 warps without a chunk; out = 336 leaves a partial row block. sms = 1 launches as if the device had one
    multiprocessor, so each block takes every row block in turn (the ring runs on across them). Outputs NaN-poisoned."""
    if sms:
        monkeypatch.setitem(gemv._sm_count, int(cp.cuda.Device().id), sms)
        monkeypatch.setattr(gemv, "PERSISTENT", {"bf16": 1, "fp8": 1, "nvfp4": 1})
    seed = secrets.randbits(32)
    case = _verify_case(fmt, 336, in_dim, np.random.default_rng(seed))
    lin, pair, xs, _, alone_glu = case
    for variant in gemv.STAGED_VARIANTS[fmt]:
        for rows in (2, 8, 13, 32):
            _assert_rows_alone(case, variant, rows, f"{fmt} in={in_dim} seed={seed} ")
        want = gemv.prepare(cp.asarray(alone_glu[:13]), "f16")
        assert cp.array_equal(pair.matmul_prepared(xs[:13], variant=variant, split="f16"), want), f"{fmt}{variant}"
    with pytest.raises(ValueError, match="unknown staged"):
        lin.matmul_prepared(xs[:8], variant="_p8n8s8")


@pytest.mark.parametrize("in_dim", [512, 2688])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_warpgroup_verify_kernels_have_the_decode_bits(fmt: str, in_dim: int) -> None:
    """gemv_mma_wg (every "_wg<NTB>s<S>" variant of the format, each class-group count 1, 2, 4, 8 and the launcher's
    own, fp32 and the glu epilogue): every row has the bits of that row computed alone (the decode kernel: mma.sync,
    here wgmma). in = 2688 gives 21 NVFP4 / 42 FP8 chunks (classes of 2-6 chunks, the stage ring wraps), in = 512
    leaves NVFP4 classes 4-7 without a chunk; out = 336 leaves a partial 128-row block; 40 and 64 rows take two token
    blocks of 32 (or three / four of 16), so the class-group workspace and tickets of several token blocks are in use
    at once. Outputs NaN-poisoned. Skipped on GPUs without wgmma (gemv.wgmma_available)."""
    if not gemv.wgmma_available():
        pytest.skip("the warpgroup kernels need sm_90")
    seed = secrets.randbits(32)
    case = _verify_case(fmt, 336, in_dim, np.random.default_rng(seed), rows=64)
    lin, pair, xs, _, alone_glu = case
    for variant in gemv.CM_VARIANTS[fmt]:
        for groups in ("", "g1", "g2", "g4", "g8"):
            for rows in (2, 13, 32, 40, 64):
                _assert_rows_alone(case, variant + groups, rows, f"{fmt} in={in_dim} seed={seed} ")
        want = gemv.prepare(cp.asarray(alone_glu[:13]), "f16")
        assert cp.array_equal(pair.matmul_prepared(xs[:13], variant=variant, split="f16"), want), f"{fmt}{variant}"
    with pytest.raises(ValueError, match="unknown warpgroup"):
        lin.matmul_prepared(xs[:8], variant="_wg8s3g3")
    with pytest.raises(ValueError, match="unknown warpgroup"):
        lin.matmul_prepared(xs[:8], variant="_wg2s2")


@pytest.mark.parametrize("optin", [99 * 1024, 163 * 1024])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_verify_without_the_staged_shared_memory(fmt: str, optin: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device that cannot give a block the staged kernels' shared memory (as sm_86 / sm_89 / sm_120: 99 KB, sm_80:
    163 KB), verify rows take the wide kernels (gemv.WIDE_FALLBACK) with the same bits."""
    monkeypatch.setitem(gemv._optin_limit, int(cp.cuda.Device().id), optin)
    seed = secrets.randbits(32)
    case = _verify_case(fmt, 336, 2048, np.random.default_rng(seed))
    for rows in (2, 4, 8, 13, 32):
        _assert_rows_alone(case, "", rows, f"{fmt} optin={optin} seed={seed} ")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gemv_glu_pair_epilogue(fmt: str) -> None:
    """glu_pair: silu(gate) · up in the GEMV's epilogue, bitwise equal to silu_mul_rows over the concatenated
    projection (fp32 and every split kind), close to the float64 reference, row-invariant. F = 136: FP8 gate rows
    128..135 take the second 128-row scale block (scales per 8 rows)."""
    from tandem.backend import numpy_ops
    from tandem.backend.cuda.silu_mul import silu_mul_rows

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    width, in_dim = 136, 1024
    (gate, gref), (up, uref) = _make(fmt, width, in_dim, rng), _make(fmt, width, in_dim, rng)
    pair, both = gemv.glu_pair(gate, up), gemv.concat([gate, up])
    assert pair.glu == width and pair.shape == (2 * width, in_dim)
    for rows in (1, 5, 33):
        x_host = rng.standard_normal((rows, in_dim)).astype(np.float32)
        xs = gemv.prepare(cp.asarray(x_host), pair.prep_kind)
        gu = both.matmul_prepared(xs)
        got = cp.asnumpy(pair.matmul_prepared(xs, out=cp.full((rows, width), np.nan, dtype=cp.float32)))
        want = cp.asnumpy(silu_mul_rows(gu))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{fmt} rows={rows} seed={seed}"
        ref = numpy_ops.silu(gref(x_host).astype(np.float32)) * uref(x_host).astype(np.float32)
        assert max_rel_error(got, ref) <= 1e-4, f"{fmt} seed={seed}"
        for split in ("f16", "f16p", "bf16"):
            parts = gemv.PARTS[split]
            poisoned = cp.full((rows, parts, width), 0xFFFF, dtype=cp.uint16)
            xs_out = cp.asnumpy(pair.matmul_prepared(xs, out=poisoned, split=split))
            assert np.array_equal(xs_out, cp.asnumpy(silu_mul_rows(gu, split=split))), f"{fmt} {split} seed={seed}"
        one = cp.asnumpy(pair.matmul_prepared(xs[rows - 1:rows].copy()))
        assert np.array_equal(one.view(np.uint32), got[rows - 1:].view(np.uint32)), f"{fmt} row invariance"


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_dim", [1040, 6160])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gemv_residual_norm_epilogue(fmt: str, prefetch: bool, out_dim: int, rows: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """matmul_residual_norm on T rows (a decode row, a small verify's ≤ resnorm_rows(): 4 for FP8 / NVFP4, 2 for
    BF16): resid += x · Wᵀ and the next RMSNorm in one launch (the last T · ceil(out / 256) blocks norm the rows from
    the blocks' tile sums of squares), bitwise equal to matmul_prepared then add_rms_norm (fp32 and every split
    kind), with and without the register prefetch kernel (gemv.RESNORM_PF); normed_out = the fp32 rows; repeated
    launches (the launch's 64-bit block count, never reset, a multiple of the tile count after each, cuda/gemv.cu
    RESNORM_EPOCH); close to the float64 reference. Outputs NaN-poisoned. out 1040: 65 tiles, 5 norming blocks a
    row, the last 16 columns; 6160: 385 tiles (threads add 2 slots), 25 norming blocks a row."""
    from tandem.backend.cuda.rms_norm import add_rms_norm, reference_add

    monkeypatch.setattr(gemv, "RESNORM_PF", (fmt,) if prefetch else ())
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    in_dim, eps = 2048, 1e-6  # 65 / 385 row tiles
    lin, ref = _make(fmt, out_dim, in_dim, rng)
    if rows > lin.resnorm_rows():
        pytest.skip(f"{fmt}: at most {lin.resnorm_rows()} rows a launch")
    w = cp.asarray((1.0 + 0.1 * rng.standard_normal(out_dim)).astype(np.float32))
    tiles = -(-out_dim // 16)
    count = gemv._counter(tiles)[:2].view(cp.uint64)
    before = int(count[0])
    assert before % tiles == 0
    for step in range(3):
        x_host = rng.standard_normal((rows, in_dim)).astype(np.float32)
        r_host = rng.standard_normal((rows, out_dim)).astype(np.float32)
        xs = gemv.prepare(cp.asarray(x_host), lin.prep_kind)
        y = lin.matmul_prepared(xs)
        for split in (None, "f16", "f16p", "bf16"):
            resid, want_resid = cp.asarray(r_host), cp.asarray(r_host)
            want = cp.asnumpy(add_rms_norm(want_resid, y, w, eps, split=split))
            normed = cp.full((rows, out_dim), np.nan, dtype=cp.float32)
            poisoned = (cp.full((rows, out_dim), np.nan, dtype=cp.float32) if split is None else
                        cp.full((rows, gemv.PARTS[split], out_dim), 0xFFFF, dtype=cp.uint16))
            got = cp.asnumpy(lin.matmul_residual_norm(xs, resid, w, eps, split=split, normed_out=normed,
                                                      out=poisoned))
            view = np.uint32 if split is None else np.uint16
            assert np.array_equal(got.view(view), want.view(view)), f"{fmt} {split} step={step} seed={seed}"
            assert np.array_equal(cp.asnumpy(resid).view(np.uint32), cp.asnumpy(want_resid).view(np.uint32))
            want_normed = cp.asnumpy(add_rms_norm(cp.asarray(r_host), y, w, eps))
            assert np.array_equal(cp.asnumpy(normed).view(np.uint32), want_normed.view(np.uint32))
        s_ref, h_ref = reference_add(r_host, ref(x_host).astype(np.float32), cp.asnumpy(w), eps)
        assert max_rel_error(cp.asnumpy(resid), s_ref) <= 1e-4, f"{fmt} seed={seed}"
        assert max_rel_error(cp.asnumpy(normed), h_ref) <= 1e-3, f"{fmt} seed={seed}"
    assert int(count[0]) == before + 3 * 4 * tiles  # 3 steps x 4 split kinds, each launch counted once a block


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gemv_residual_norm_unfused_on_small_devices(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device with too few multiprocessors for the fused tail's waiting blocks (T · ceil(out / 256) > 2 · SMs), or
    a launch with more waiting blocks than blocks (T · ceil(out / 256) > tiles: out = 48 at 4 rows), takes the
    unfused path (the GEMV, then add_rms_norm, then prepare): the same bits as the fused launch (or, for the second,
    as matmul_prepared then add_rms_norm) for every split kind, with and without normed_out, and the residual updated
    once."""
    dev = int(cp.cuda.Device().id)
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    out_dim, in_dim, eps = 1040, 2048, 1e-6  # 5 norming blocks
    lin, _ = _make(fmt, out_dim, in_dim, rng)
    w = cp.asarray((1.0 + 0.1 * rng.standard_normal(out_dim)).astype(np.float32))
    rows = lin.resnorm_rows()  # the most a launch takes: the fused form's waiting blocks are rows · 5
    xs = gemv.prepare(cp.asarray(rng.standard_normal((rows, in_dim)).astype(np.float32)), lin.prep_kind)
    r_host = rng.standard_normal((rows, out_dim)).astype(np.float32)
    for split in (None, "f16", "f16p", "bf16"):
        for with_normed in (False, True):
            got = []
            for sms in (None, 1):  # the device's own count (fused), then 1 SM (unfused)
                cache = dict(gemv._sm_count)
                if sms is not None:
                    cache[dev] = sms
                monkeypatch.setattr(gemv, "_sm_count", cache)
                resid = cp.asarray(r_host)
                normed = cp.full((rows, out_dim), np.nan, dtype=cp.float32) if with_normed else None
                res = lin.matmul_residual_norm(xs, resid, w, eps, split=split, normed_out=normed)
                got.append([cp.asnumpy(a) for a in (res, resid) + ((normed,) if with_normed else ())])
            for a, b in zip(*got):
                view = np.uint16 if a.dtype == np.uint16 else np.uint32
                assert np.array_equal(a.view(view), b.view(view)), f"{fmt} {split} normed={with_normed} seed={seed}"


def test_gemv_residual_norm_rejects_rows_past_its_slots() -> None:
    """A residual + norm GEMV has one sum-of-squares slot a 16-row tile (gemv.RESNORM_SLOTS): a longer output, or more
    rows than one MMA column tile (resnorm_rows), is a ValueError before anything launches, and the residual is
    untouched."""
    rng = np.random.default_rng(0)
    for fmt, out_dim, rows in (("bf16", 16 * gemv.RESNORM_SLOTS + 16, 1), ("bf16", 64, 3), ("fp8", 64, 5)):
        lin, _ = _make(fmt, out_dim, 128, rng)
        xs = gemv.prepare(cp.zeros((rows, 128), dtype=cp.float32), lin.prep_kind)
        resid = cp.ones((rows, out_dim), dtype=cp.float32)
        with pytest.raises(ValueError, match="at most|rows"):
            lin.matmul_residual_norm(xs, resid, cp.ones(out_dim, dtype=cp.float32), 1e-6)
        assert bool((resid == 1.0).all())


@pytest.mark.parametrize("out_dim", [48, 16 * (gemv.RESNORM_SLOTS // 4 + 1)])
def test_gemv_residual_norm_rows_past_its_blocks_or_slots_run_unfused(out_dim: int) -> None:
    """4 rows whose fused tail cannot run: out = 48 has 3 tiles for 4 waiting blocks (one a row), out = 32784 has
    2049 tiles, 4 · 2049 slots past RESNORM_SLOTS. Both take the unfused launches: the bits of matmul_prepared then
    add_rms_norm (fp32 and split), the residual updated once, normed_out written."""
    from tandem.backend.cuda.rms_norm import add_rms_norm

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    rows, in_dim, eps = 4, 128, 1e-6
    lin, _ = _make("fp8", out_dim, in_dim, rng)
    w = cp.asarray((1.0 + 0.1 * rng.standard_normal(out_dim)).astype(np.float32))
    xs = gemv.prepare(cp.asarray(rng.standard_normal((rows, in_dim)).astype(np.float32)), lin.prep_kind)
    r_host = rng.standard_normal((rows, out_dim)).astype(np.float32)
    y = lin.matmul_prepared(xs)
    for split in (None, "f16"):
        resid, want_resid = cp.asarray(r_host), cp.asarray(r_host)
        want = cp.asnumpy(add_rms_norm(want_resid, y, w, eps, split=split))
        normed = cp.full((rows, out_dim), np.nan, dtype=cp.float32)
        got = cp.asnumpy(lin.matmul_residual_norm(xs, resid, w, eps, split=split, normed_out=normed))
        view = np.uint32 if split is None else np.uint16
        assert np.array_equal(got.view(view), want.view(view)), f"out={out_dim} {split} seed={seed}"
        assert np.array_equal(cp.asnumpy(resid).view(np.uint32), cp.asnumpy(want_resid).view(np.uint32))
        want_normed = cp.asnumpy(add_rms_norm(cp.asarray(r_host), y, w, eps))
        assert np.array_equal(cp.asnumpy(normed).view(np.uint32), want_normed.view(np.uint32))


@pytest.mark.parametrize("taps", [3, 4])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gemv_conv_epilogue_is_the_gdn_decode_conv(fmt: str, taps: int) -> None:
    """matmul_conv (the GDN conv in the in-projection's epilogue) then gdn_decode(conv_done=True) gives the bits of
    matmul_prepared then gdn_decode (its own conv launch): output, state and tail, over three steps; y's z | a | b
    rows equal the plain GEMV's. Outputs NaN-poisoned. NVFP4 with 4 taps loads the tail and weights before its main
    loop (cuda/gemv.cu EPI_PREFETCH), other tap counts in the epilogue."""
    from tandem.backend.cuda.gdn_seq import gdn_decode

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    hk, hv, d, in_dim = 2, 8, 64, 1024
    c = 2 * hk * d + hv * d
    proj = gemv.concat([_make(fmt, n, in_dim, rng)[0] for n in (c, hv * d, hv, hv)])
    conv_w = cp.asarray(rng.standard_normal((c, taps)).astype(np.float32) * 0.3)
    tail0 = rng.standard_normal((taps - 1, c)).astype(np.float32)
    state0 = (rng.standard_normal((hv, d, d)) * 0.1).astype(np.float32)
    a_log, dt = cp.asarray(rng.standard_normal(hv).astype(np.float32)), cp.zeros(hv, cp.float32)
    norm_w = cp.ones(d, cp.float32)
    runs = []
    for fused in (False, True):
        tail, state = cp.asarray(tail0), cp.asarray(state0)
        outs = []
        for step in range(3):
            x = cp.asarray(np.random.default_rng(seed + step).standard_normal((1, in_dim)).astype(np.float32))
            xs = gemv.prepare(x, proj.prep_kind)
            y = cp.full((1, proj.shape[0]), np.nan, dtype=cp.float32)
            if fused:
                proj.matmul_conv(xs, tail, conv_w, out=y)
            else:
                proj.matmul_prepared(xs, out=y)
            cuts = (0, c, c + hv * d, c + hv * d + hv, c + hv * d + 2 * hv)
            u, z, a, b = (cp.ascontiguousarray(y[:, s:e]) for s, e in zip(cuts[:-1], cuts[1:]))
            o = gdn_decode(u, tail, conv_w, a, b, a_log, dt, z, norm_w, state, hk, 1e-6, conv_done=fused)
            outs += [cp.asnumpy(o).view(np.uint32), cp.asnumpy(y[:, c:]).view(np.uint32)]
        runs.append(outs + [cp.asnumpy(state).view(np.uint32), cp.asnumpy(tail).view(np.uint32)])
    for got, want in zip(runs[1], runs[0]):
        assert np.array_equal(got, want), f"{fmt} taps={taps} seed={seed}"
