"""NumPy reference ops against float64 formulas and against each other, and row invariance of the decode path.

Sources: tandem/backend/numpy_ops.py (spec/qwen3_5.md §3–§5), tandem/formats/linear.py (DESIGN.md "matrix rows").
"""

from __future__ import annotations

import numpy as np
import pytest

from tandem.backend import numpy_ops as ops
from tandem.formats import DenseLinear

F32 = np.float32


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def _gdn_inputs(rng: np.random.Generator, t: int, hv: int = 4, dk: int = 16, dv: int = 24
                ) -> tuple[np.ndarray, ...]:
    """q, k (L2-normalised, q scaled by dk^-1/2), v, g (≤ 0), beta in (0, 1), as the model prepares them."""
    q = ops.l2norm(rng.standard_normal((t, hv, dk)).astype(F32)) * F32(dk ** -0.5)
    k = ops.l2norm(rng.standard_normal((t, hv, dk)).astype(F32))
    v = rng.standard_normal((t, hv, dv)).astype(F32)
    g = (-rng.uniform(0.0, 0.5, (t, hv))).astype(F32)
    beta = rng.uniform(0.05, 0.95, (t, hv)).astype(F32)
    return q.astype(F32), k, v, g, beta


# --------------------------------------------------------------------------------------------- gated delta rule
@pytest.mark.parametrize("zero_state", [True, False])
def test_gdn_chunk_equals_repeated_step(zero_state: bool) -> None:
    rng = np.random.default_rng(0 if zero_state else 1)
    for t in range(1, ops.GDN_CHUNK + 1):
        q, k, v, g, beta = _gdn_inputs(rng, t)
        s0 = np.zeros((4, 16, 24), F32) if zero_state else rng.standard_normal((4, 16, 24)).astype(F32)
        s_step, s_chunk = s0.copy(), s0.copy()
        o_step = np.stack([ops.gdn_step(s_step, q[i], k[i], v[i], g[i], beta[i]) for i in range(t)])
        o_chunk = ops.gdn_chunk(s_chunk, q, k, v, g, beta)
        assert o_chunk.dtype == F32 and o_chunk.shape == (t, 4, 24)
        assert _rel(o_chunk, o_step.astype(np.float64)) < 1e-5, t
        assert _rel(s_chunk, s_step.astype(np.float64)) < 1e-5, t


def test_gdn_step_against_float64_formula() -> None:
    rng = np.random.default_rng(2)
    q, k, v, g, beta = _gdn_inputs(rng, 1)
    s = rng.standard_normal((4, 16, 24)).astype(F32)
    ref = s.astype(np.float64) * np.exp(g[0].astype(np.float64))[:, None, None]
    kk, vv, qq = k[0].astype(np.float64), v[0].astype(np.float64), q[0].astype(np.float64)
    for h in range(4):  # S := S + β k (v − Sᵀk)ᵀ ; o = Sᵀ q
        ref[h] += beta[0, h] * np.outer(kk[h], vv[h] - ref[h].T @ kk[h])
    o = ops.gdn_step(s, q[0], k[0], v[0], g[0], beta[0])
    o_ref = np.einsum("hkv,hk->hv", ref, qq)
    assert _rel(s, ref) < 1e-6 and _rel(o, o_ref) < 1e-6


# --------------------------------------------------------------------------------------------- conv, norms, gates
def test_causal_conv_against_loop() -> None:
    rng = np.random.default_rng(3)
    kk, c, t = 4, 40, 9
    window = rng.standard_normal((kk - 1 + t, c)).astype(F32)
    weight = rng.standard_normal((c, kk)).astype(F32)
    ref = np.zeros((t, c))
    for ti in range(t):
        for ci in range(c):
            acc = sum(float(weight[ci, j]) * float(window[ti + j, ci]) for j in range(kk))
            ref[ti, ci] = acc / (1.0 + np.exp(-acc))
    out = ops.causal_conv(window, weight)
    assert out.dtype == F32 and out.shape == (t, c)
    assert _rel(out, ref) < 1e-6


def test_rms_norm_against_float64() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 3, 64)).astype(F32) * F32(3.0)
    w = (1.0 + 0.1 * rng.standard_normal(64)).astype(F32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w
    out = ops.rms_norm(x, w, 1e-6)
    assert out.dtype == F32 and _rel(out, ref) < 1e-6


def test_gated_rms_norm_against_float64() -> None:
    rng = np.random.default_rng(5)
    o = rng.standard_normal((7, 4, 32)).astype(F32)
    z = rng.standard_normal((7, 4, 32)).astype(F32)
    w = (1.0 + 0.1 * rng.standard_normal(32)).astype(F32)
    o64, z64 = o.astype(np.float64), z.astype(np.float64)
    ref = w * o64 / np.sqrt((o64 * o64).mean(-1, keepdims=True) + 1e-6) * (z64 / (1.0 + np.exp(-z64)))
    out = ops.gated_rms_norm(o, z, w, 1e-6)
    assert out.dtype == F32 and _rel(out, ref) < 1e-6


def test_l2norm_against_float64() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 4, 16)).astype(F32)
    x[0, 0] = 1e-5  # tiny row: the epsilon on the sum matters
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).sum(-1, keepdims=True) + 1e-6)
    out = ops.l2norm(x)
    assert out.dtype == F32 and float(np.abs(out - ref).max()) < 1e-6
    assert np.allclose(np.linalg.norm(out[1:], axis=-1), 1.0, atol=1e-6)


def test_gates_and_activations_against_float64() -> None:
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((5, 4)).astype(F32) * 10, rng.standard_normal((5, 4)).astype(F32)
    a_log, dt = rng.standard_normal(4).astype(F32), rng.standard_normal(4).astype(F32)
    g, beta = ops.gdn_gates(a, b, a_log, dt)
    x = (a + dt).astype(np.float64)
    sp = np.where(x > 20, x, np.log1p(np.exp(x)))
    assert _rel(g, -np.exp(a_log.astype(np.float64)) * sp) < 1e-6
    assert _rel(beta, 1 / (1 + np.exp(-b.astype(np.float64)))) < 1e-6
    assert (g <= 0).all()
    xs = np.array([-30.0, -1.0, 0.0, 2.0, 25.0], F32)
    assert _rel(ops.silu(xs), xs / (1 + np.exp(-xs.astype(np.float64)))) < 1e-6
    assert ops.softplus(np.array([25.0], F32))[0] == F32(25.0)


# --------------------------------------------------------------------------------------------- rope, attention
def test_apply_rope_against_float64() -> None:
    rng = np.random.default_rng(8)
    t, nh, d, rd, theta = 6, 3, 32, 8, 10000.0
    pos = np.array([0, 1, 7, 63, 64, 1000])
    x = rng.standard_normal((t, nh, d)).astype(F32)
    inv = theta ** (-np.arange(0, rd, 2) / rd)
    ang = pos[:, None] * inv[None, :]
    cos64, sin64 = np.cos(ang), np.sin(ang)
    cos, sin = ops.rope_tables(pos, rd, theta)
    assert float(np.abs(cos - cos64).max()) < 1e-4 and float(np.abs(sin - sin64).max()) < 1e-4  # fp32 angles
    x64 = x.astype(np.float64)
    half = rd // 2
    ref = x64.copy()
    c, s = cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
    ref[..., :half] = x64[..., :half] * c - x64[..., half:rd] * s
    ref[..., half:rd] = x64[..., half:rd] * c + x64[..., :half] * s
    out = x.copy()
    ops.apply_rope(out, cos, sin)
    assert _rel(out, ref) < 1e-6
    np.testing.assert_array_equal(out[..., rd:], x[..., rd:])  # channels past rotary_dim untouched
    np.testing.assert_array_equal(out[0], x[0])  # position 0 is the identity


@pytest.mark.parametrize("start,t,h,hkv", [(0, 9, 4, 2), (37, 5, 4, 4), (100, 1, 6, 2)])
def test_attention_prefill_rows_equal_decode(start: int, t: int, h: int, hkv: int) -> None:
    rng = np.random.default_rng(start)
    d = 16
    q = rng.standard_normal((t, h, d)).astype(F32)
    keys = rng.standard_normal((start + t, hkv, d)).astype(F32)
    values = rng.standard_normal((start + t, hkv, d)).astype(F32)
    out = ops.attention_prefill(q, keys, values, start)
    assert out.shape == (t, h, d) and out.dtype == F32
    for i in range(t):
        s = start + i + 1
        dec = ops.attention_decode(q[i], keys[:s], values[:s])
        assert _rel(out[i], dec.astype(np.float64)) < 1e-6
        # float64 softmax attention, GQA: head j uses KV head j // (h / hkv)
        kk, vv = keys[:s].astype(np.float64), values[:s].astype(np.float64)
        for j in range(h):
            sc = kk[:, j // (h // hkv)] @ q[i, j].astype(np.float64) / np.sqrt(d)
            p = np.exp(sc - sc.max())
            ref = (p / p.sum()) @ vv[:, j // (h // hkv)]
            assert np.abs(dec[j] - ref).max() < 1e-5 * max(1.0, np.abs(ref).max())


# --------------------------------------------------------------------------------------------- row invariance
@pytest.mark.parametrize("rows", [1, 2, 7, 32])
def test_dense_linear_rows_match_one_row_calls(rows: int) -> None:
    rng = np.random.default_rng(rows)
    lin = DenseLinear(rng.standard_normal((96, 80)).astype(F32))
    x = rng.standard_normal((rows, 80)).astype(F32)
    y = lin.matmul(x)
    for i in range(rows):
        np.testing.assert_array_equal(y[i], lin.matmul(x[i:i + 1])[0])
        np.testing.assert_array_equal(y[i], lin.matmul(np.ascontiguousarray(x[i:i + 1]))[0])
    # a row taken from an odd offset in a bigger buffer (alignment varies) still gets the same bits
    big = np.zeros(80 * rows + 1, F32)
    big[1:] = x.reshape(-1)
    np.testing.assert_array_equal(lin.matmul(big[1:].reshape(rows, 80)), y)
    assert np.abs(y - x.astype(np.float64) @ lin.weight.T.astype(np.float64)).max() < 1e-4


def test_dense_linear_rejects_bad_input() -> None:
    lin = DenseLinear(np.zeros((4, 3), F32), "w")
    with pytest.raises(ValueError, match=r"w: x must be \[T, 3\] float32"):
        lin.matmul(np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match="must be 2-D float32"):
        DenseLinear(np.zeros(3, F32))


def test_attention_decode_rows_match_one_row_calls() -> None:
    """Verify rows (queries over nested key prefixes of one preallocated buffer) get the bits of decode calls."""
    rng = np.random.default_rng(11)
    max_len, hkv, h, d = 64, 2, 4, 16
    kc = rng.standard_normal((max_len, hkv, d)).astype(F32)
    vc = rng.standard_normal((max_len, hkv, d)).astype(F32)
    qs = rng.standard_normal((8, h, d)).astype(F32)
    batch = [ops.attention_decode(qs[i], kc[:30 + i], vc[:30 + i]) for i in range(8)]
    for i in range(8):
        one = ops.attention_decode(qs[i].copy(), np.ascontiguousarray(kc[:30 + i]).copy(),
                                   np.ascontiguousarray(vc[:30 + i]).copy())
        np.testing.assert_array_equal(batch[i], one)


def test_gdn_step_rows_match_one_row_calls() -> None:
    """Per-node states of a tree (rows of a stack) step with the bits of a standalone decode step."""
    rng = np.random.default_rng(12)
    q, k, v, g, beta = _gdn_inputs(rng, 5)
    s0 = rng.standard_normal((4, 16, 24)).astype(F32)
    stack = np.stack([s0] * 5)  # [N, Hv, dk, dv]
    outs = [ops.gdn_step(stack[i], q[i], k[i], v[i], g[i], beta[i]) for i in range(5)]
    for i in range(5):
        alone = s0.copy()
        o = ops.gdn_step(alone, q[i].copy(), k[i].copy(), v[i].copy(), g[i].copy(), beta[i].copy())
        np.testing.assert_array_equal(outs[i], o)
        np.testing.assert_array_equal(stack[i], alone)
