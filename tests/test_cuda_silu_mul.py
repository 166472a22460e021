"""CUDA SiLU · mul (cuda/silu_mul.cu) vs numpy_ops.silu(gate) * up on fresh random inputs.

Checks: relative error ≤ 1e-6 (norm) / 1e-5 (max), a NaN-poisoned output fully written, elementwise (so row
invariance holds by construction: a row's bits for 1 row vs 32 rows are compared anyway), ValueError.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import silu_mul as sm  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]


@pytest.mark.parametrize("shape", [(1, 12288), (32, 12288), (5, 17)])
def test_silu_mul(shape: tuple[int, int]) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    y = cp.full(shape, np.nan, dtype=cp.float32)
    sm.silu_mul(cp.asarray(g), cp.asarray(u), out=y)
    got, ref = cp.asnumpy(y), sm.reference(g, u)
    err, merr = rel_error(got, ref), max_rel_error(got, ref)
    assert err <= 1e-6 and merr <= 1e-5, f"seed={seed}: rel {err:.3g} max rel {merr:.3g}"
    one = cp.asnumpy(sm.silu_mul(cp.asarray(g[-1:]), cp.asarray(u[-1:])))
    assert np.array_equal(one, got[-1:])
    record(f"silu_mul{list(shape)}", rel=err, max_rel=merr, row_invariant=True, seed=seed)


def test_silu_mul_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="up"):
        sm.silu_mul(cp.zeros((2, 8), cp.float32), cp.zeros((2, 4), cp.float32))


@pytest.mark.parametrize("split", [None, "f16", "f16p", "bf16"])
def test_silu_mul_rows(split: str | None) -> None:
    """The fused gate|up input: fp32 result within the reference's bounds, and the split operand bitwise what
    gemv.prepare makes of it (NaN-poisoned outputs fully written)."""
    from tandem.backend.cuda import gemv

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((5, 2 * 1024)) * 3).astype(np.float32)
    y = cp.full((5, 1024), np.nan, dtype=cp.float32)
    sm.silu_mul_rows(cp.asarray(gu), out=y)
    ref = sm.reference(gu[:, :1024], gu[:, 1024:])
    assert max_rel_error(cp.asnumpy(y), ref) <= 1e-5, f"seed={seed}"
    if split is not None:
        parts = 3 if split == "bf16" else 2
        xs = cp.full((5, parts, 1024), 0xFFFF, dtype=cp.uint16)
        sm.silu_mul_rows(cp.asarray(gu), out=xs, split=split)
        assert cp.array_equal(xs, gemv.prepare(y, split)), f"{split} seed={seed}"
