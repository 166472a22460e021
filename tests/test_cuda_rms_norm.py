"""CUDA RMSNorm and fused residual + RMSNorm (cuda/rms_norm.cu) vs numpy_ops.rms_norm on fresh random inputs.

Checks: relative error ≤ 1e-5, NaN-poisoned outputs fully written, the residual update bitwise equal to NumPy's
fp32 add, row invariance (a row's bits for 1 row vs 32 rows), add_rms_norm's summation order (bitwise against a
float32 emulation), ValueError on bad arguments.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import rms_norm as rn  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

TOL = 1e-5


# rows of ≤ 5120 columns are held in registers (common.cuh norm_row), longer ones take the batched loops
@pytest.mark.parametrize("shape", [(1, 4096), (32, 4096), (32, 5120), (2, 6160), (3, 16, 256), (7, 64), (2, 100)])
def test_rms_norm(shape: tuple[int, ...]) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 10)).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
    y = cp.full(shape, np.nan, dtype=cp.float32)
    rn.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, out=y)
    got, ref = cp.asnumpy(y), rn.reference(x, w, 1e-6)
    err, merr = rel_error(got, ref), max_rel_error(got, ref)
    assert err <= TOL and merr <= TOL, f"{shape} seed={seed}: rel {err:.3g} max rel {merr:.3g}"
    flat = x.reshape(-1, shape[-1])
    one = cp.asnumpy(rn.rms_norm(cp.asarray(flat[-1:]), cp.asarray(w), 1e-6))
    assert np.array_equal(one.view(np.uint32), got.reshape(-1, shape[-1])[-1:].view(np.uint32)), "row invariance"
    record(f"rms_norm{list(shape)}", rel=err, max_rel=merr, row_invariant=True, seed=seed)


@pytest.mark.parametrize("cols", [4096, 6160])
@pytest.mark.parametrize("rows", [1, 32])
def test_add_rms_norm(rows: int, cols: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    d = rng.standard_normal((rows, cols)).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    xd = cp.asarray(x)
    y = cp.full((rows, cols), np.nan, dtype=cp.float32)
    rn.add_rms_norm(xd, cp.asarray(d), cp.asarray(w), 1e-6, out=y)
    s_ref, y_ref = rn.reference_add(x, d, w, 1e-6)
    assert np.array_equal(cp.asnumpy(xd), s_ref), "residual update must equal NumPy's fp32 add"
    err = max_rel_error(cp.asnumpy(y), y_ref)
    assert err <= TOL, f"seed={seed}: max rel {err:.3g}"
    record(f"add_rms_norm[{rows}x{cols}]", max_rel=err, seed=seed)


def _block_sum(v: np.ndarray) -> np.float32:
    """common.cuh block_sum of 256 float32 values as the device adds them: each warp's butterfly (xor 16 .. 1), then
    lanes 0..7 hold the 8 warp sums (the rest 0) and one more butterfly."""
    lanes = np.arange(32)
    w = v.reshape(8, 32).astype(np.float32)
    for m in (16, 8, 4, 2, 1):
        w = w + w[:, lanes ^ m]
    t = np.zeros(32, np.float32)
    t[:8] = w[:, 0]
    for m in (16, 8, 4, 2, 1):
        t = t + t[lanes ^ m]
    return np.float32(t[0])


def _tile_order_norm(x: np.ndarray, d: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """add_rms_norm of one row in the residual norm's order (common.cuh norm_row_tiles / cuda/gemv.cu's tile
    slots), in float32 with NumPy's correctly rounded operations: the device's bits."""
    cols = x.shape[0]
    s = (x + d).astype(np.float32)
    tiles = -(-cols // 16)
    q = np.zeros(tiles * 16, np.float32)
    q[:cols] = s * s
    q = q.reshape(tiles, 16)
    for m in (8, 4, 2, 1):
        q[:, :m] = q[:, :m] + q[:, m:2 * m]
    ss = np.zeros(256, np.float32)
    for j in range(tiles):
        ss[j % 256] = ss[j % 256] + q[j, 0]
    inv = np.float32(1.0) / np.sqrt(_block_sum(ss) / np.float32(cols) + np.float32(eps))
    return ((s * inv).astype(np.float32) * w).astype(np.float32)


@pytest.mark.parametrize("cols", [5120, 4096, 6160, 1040, 100, 30])
def test_add_rms_norm_sums_in_tile_order(cols: int) -> None:
    """add_rms_norm's bits are those of the residual norm's documented order (16-column tile butterflies, then the
    tiles by thread, then block_sum), which the decode GEMV's residual + norm epilogue shares: each row equals a
    float32 NumPy emulation of that order bit for bit (partial last tiles, rows of cols % 4 != 0, threads with 2
    tiles included)."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    d = (rng.standard_normal((2, cols)) * 0.5).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    got = cp.asnumpy(rn.add_rms_norm(cp.asarray(x), cp.asarray(d), cp.asarray(w), 1e-6))
    for r in range(2):
        want = _tile_order_norm(x[r], d[r], w, 1e-6)
        assert np.array_equal(got[r].view(np.uint32), want.view(np.uint32)), f"row {r} cols={cols} seed={seed}"


def test_rms_norm_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="weight"):
        rn.rms_norm(cp.zeros((2, 8), cp.float32), cp.zeros(4, cp.float32), 1e-6)
    with pytest.raises(ValueError, match="x"):
        rn.rms_norm(cp.zeros((2, 8), cp.float64), cp.zeros(8, cp.float32), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        rn.add_rms_norm(cp.zeros((2, 8), cp.float32), cp.zeros((1, 8), cp.float32), cp.zeros(8, cp.float32), 1e-6)


@pytest.mark.parametrize("split", ["f16", "f16p", "bf16"])
def test_norm_writes_the_gemv_operand(split: str) -> None:
    """split=...: the kernel writes the next GEMV's operand, bitwise what gemv.prepare makes of the fp32 result
    (NaN-poisoned output fully written), for both the plain and the residual form."""
    from tandem.backend.cuda import gemv

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 5120)).astype(np.float32)
    d = rng.standard_normal((3, 5120)).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(5120)).astype(np.float32)
    parts = 3 if split == "bf16" else 2
    xs = cp.full((3, parts, 5120), 0xFFFF, dtype=cp.uint16)
    rn.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, out=xs, split=split)
    want = gemv.prepare(rn.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6), split)
    assert cp.array_equal(xs, want), f"{split} seed={seed}"
    xd, xd2 = cp.asarray(x), cp.asarray(x)
    got = rn.add_rms_norm(xd, cp.asarray(d), cp.asarray(w), 1e-6, split=split)
    want = gemv.prepare(rn.add_rms_norm(xd2, cp.asarray(d), cp.asarray(w), 1e-6), split)
    assert cp.array_equal(got, want) and cp.array_equal(xd, xd2), f"{split} seed={seed}"
    ref = rn.reference(x, w, 1e-6)
    assert not np.isnan(ref).any()
