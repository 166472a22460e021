"""The NumPy twin of the chunked GDN scan (tandem/backend/cuda/gdn_chunk.py ``reference`` / ``reference_scan``: the
algorithm of cuda/gdn_chunk.cu in fp32) against the recurrent reference, on the CPU (no GPU, no CuPy).

Checks: the twin's y and state within relative 2e-5 ("3xtf32") / 2e-3 ("tf32") of gdn_seq.reference_prefill, the conv
tail bitwise, for calls of 1 to 300 tokens from a grid position and from off it; against a float64 recurrence over
2,048 tokens of slowly decaying heads: within 5e-6 / 2e-3 (measured ~5e-7 / ~5e-4, the same at 32k tokens); chunk
invariance: a 300-token call from a grid position equals the same tokens in calls cut at multiples of 64 (a partial
last chunk included), bit for bit; TF32 rounding is round-to-nearest, ties away from zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from tandem.backend import numpy_ops
from tandem.backend.cuda import gdn_chunk as gc
from tandem.backend.cuda import gdn_seq
from tandem.backend.cuda.checks import rel_error

EPS = 1e-6
TOL = {"3xtf32": 2e-5, "tf32": 2e-3}
F32 = np.float32


class _Layer:
    """A random GDN layer (host float32) and its entry tail / state; ``slow`` decays its heads over ~10-100 tokens."""

    def __init__(self, seed: int, shape: tuple[int, int, int, int, int], slow: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.shape = hk, hv, dk, dv, taps = shape
        self.c = 2 * hk * dk + hv * dv
        self.conv_w = self.f32(self.c, taps, scale=0.5)
        self.a_log = np.log(self.rng.uniform(0.01, 0.1, hv) if slow else self.rng.uniform(1, 16, hv)).astype(F32)
        self.dt_bias, self.norm_w = self.f32(hv, scale=0.5), (1.0 + self.f32(dv, scale=0.1)).astype(F32)
        self.tail, self.state = self.f32(taps - 1, self.c), self.f32(hv, dk, dv, scale=0.1)

    def f32(self, *s: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(s) * scale).astype(F32)

    def tokens(self, n: int) -> tuple[np.ndarray, ...]:
        hv, dv = self.shape[1], self.shape[3]
        return self.f32(n, self.c), self.f32(n, hv), self.f32(n, hv), self.f32(n, hv * dv)

    def twin(self, toks: tuple[np.ndarray, ...], tail: np.ndarray, state: np.ndarray, start: int,
             precision: str) -> np.ndarray:
        mixed, a, b, z = toks
        return gc.reference(mixed, tail, self.conv_w, a, b, self.a_log, self.dt_bias, z, self.norm_w, state,
                            self.shape[0], EPS, start, precision)


SHAPES = [(4, 8, 64, 64, 4), (1, 2, 128, 128, 4), (2, 2, 32, 64, 2)]


@pytest.mark.parametrize("precision", sorted(gc.PRECISIONS))
@pytest.mark.parametrize("num_tokens,start", [(1, 0), (63, 0), (65, 0), (300, 0), (1, 63), (100, 37), (300, 64)])
@pytest.mark.parametrize("shape", SHAPES)
def test_twin_matches_the_recurrent_reference(shape: tuple[int, int, int, int, int], num_tokens: int, start: int,
                                              precision: str) -> None:
    ly = _Layer(num_tokens * 7 + start, shape, slow=True)
    toks = ly.tokens(num_tokens)
    tail, state = ly.tail.copy(), ly.state.copy()
    got = ly.twin(toks, tail, state, start, precision)
    tail_r, state_r = ly.tail.copy(), ly.state.copy()
    mixed, a, b, z = toks
    want = gdn_seq.reference_prefill(mixed, tail_r, ly.conv_w, a, b, ly.a_log, ly.dt_bias, z, ly.norm_w, state_r,
                                     shape[0], EPS)
    ey, es = rel_error(got, want), rel_error(state, state_r)
    assert ey <= TOL[precision] and es <= TOL[precision], f"y {ey:.3g}, state {es:.3g}"
    assert np.array_equal(tail, tail_r)


def _recurrent_f64(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                   beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule token by token in float64 (the exact-arithmetic yardstick): (o [T, Hv, dv], state)."""
    s = state.astype(np.float64)
    out = np.empty(v.shape, np.float64)
    for t in range(q.shape[0]):
        s *= np.exp(g[t].astype(np.float64))[:, None, None]
        kt = k[t].astype(np.float64)
        d = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", kt, s))
        s += kt[:, :, None] * d[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t].astype(np.float64), s)
    return out, s


@pytest.mark.parametrize("precision,tol", [("3xtf32", 5e-6), ("tf32", 2e-3)])
def test_twin_error_against_float64_over_a_long_call(precision: str, tol: float) -> None:
    rng = np.random.default_rng(5)
    n, hv, dk, dv = 2048, 2, 128, 128
    q = numpy_ops.l2norm(rng.standard_normal((n, hv, dk)).astype(F32)) * F32(dk ** -0.5)
    k = numpy_ops.l2norm(rng.standard_normal((n, hv, dk)).astype(F32))
    v = rng.standard_normal((n, hv, dv)).astype(F32)
    g, beta = numpy_ops.gdn_gates(rng.standard_normal((n, hv)).astype(F32), rng.standard_normal((n, hv)).astype(F32),
                                  np.log(rng.uniform(0.001, 0.05, hv)).astype(F32), np.zeros(hv, F32))
    state = (rng.standard_normal((hv, dk, dv)) * 0.1).astype(F32)
    want_o, want_s = _recurrent_f64(state, q.astype(F32), k, v, g, beta)
    got = gc.reference_scan(state, q.astype(F32), k, v, g, beta, 0, precision)
    ey, es = rel_error(got, want_o), rel_error(state, want_s)
    assert ey <= tol and es <= tol, f"{precision}: y {ey:.3g}, state {es:.3g}"


@pytest.mark.parametrize("precision", sorted(gc.PRECISIONS))
def test_twin_is_invariant_to_cuts_on_the_grid(precision: str) -> None:
    ly = _Layer(46, SHAPES[0], slow=True)
    toks = ly.tokens(300)
    tail_w, state_w = ly.tail.copy(), ly.state.copy()
    want = ly.twin(toks, tail_w, state_w, 0, precision)
    for cuts in ([64], [64, 192], [128, 256], [64, 128, 192, 256]):
        tail, state = ly.tail.copy(), ly.state.copy()
        edges = [0, *cuts, 300]
        got = np.concatenate([ly.twin(tuple(t[a:b] for t in toks), tail, state, a, precision)
                              for a, b in zip(edges, edges[1:])])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), cuts
        assert np.array_equal(state.view(np.uint32), state_w.view(np.uint32)), cuts
        assert np.array_equal(tail, tail_w), cuts


def test_tf32_rounds_to_nearest_ties_away() -> None:
    one = F32(1.0)
    ulp = F32(2.0 ** -10)  # TF32's spacing at 1
    x = np.array([one + ulp / 2, -(one + ulp / 2), one + ulp / 4, one + ulp * F32(0.75), 3.0], F32)
    want = np.array([one + ulp, -(one + ulp), one, one + ulp, 3.0], F32)
    assert np.array_equal(gc.tf32(x), want)
