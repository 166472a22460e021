"""CUDA GDN decode step (cuda/gdn_step.cu) vs the NumPy composition (conv step, L2 norms, gates, gated delta
rule, gated RMSNorm) over several consecutive tokens, on fresh random inputs.

Checks: y and the state within relative 1e-4 / 1e-5, the conv tail bitwise equal (a pure shift), a NaN-poisoned
output fully written, ValueError on bad arguments. (One token a launch: row invariance is the verify kernel's.)
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import gdn_step as gs  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (Hk, Hv, dk, dv, K): the embedded default model's GDN and Qwen3.5-9B's
SHAPES = [(4, 8, 64, 64, 4), (16, 32, 128, 128, 4)]


@pytest.mark.parametrize("shape", SHAPES)
def test_gdn_decode_step(shape: tuple[int, int, int, int, int]) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    hk, hv, dk, dv, taps = shape
    c = 2 * hk * dk + hv * dv

    def f32(*s: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(s) * scale).astype(np.float32)

    conv_w, a_log = f32(c, taps, scale=0.5), np.log(rng.uniform(1, 16, hv)).astype(np.float32)
    dt_bias, norm_w = f32(hv, scale=0.5), (1.0 + f32(dv, scale=0.1)).astype(np.float32)
    tail, state = f32(taps - 1, c), f32(hv, dk, dv, scale=0.1)
    tail_d, state_d = cp.asarray(tail), cp.asarray(state)
    dev = [cp.asarray(t) for t in (conv_w, a_log, dt_bias, norm_w)]
    worst_y = worst_s = 0.0
    for step in range(4):
        mixed, a, b, z = f32(c), f32(hv), f32(hv), f32(hv * dv)
        y = cp.full(hv * dv, np.nan, dtype=cp.float32)
        gs.gdn_decode_step(cp.asarray(mixed), tail_d, dev[0], cp.asarray(a), cp.asarray(b), dev[1], dev[2],
                           cp.asarray(z), dev[3], state_d, hk, 1e-6, out=y)
        y_ref = gs.reference(mixed, tail, conv_w, a, b, a_log, dt_bias, z, norm_w, state, hk, 1e-6)
        got_y, got_s = cp.asnumpy(y), cp.asnumpy(state_d)
        ey, es = max(rel_error(got_y, y_ref), max_rel_error(got_y, y_ref)), rel_error(got_s, state)
        assert ey <= 1e-4 and es <= 1e-5, f"{shape} step {step} seed={seed}: y {ey:.3g}, state {es:.3g}"
        assert np.array_equal(cp.asnumpy(tail_d), tail), f"{shape} step {step}: conv tail differs"
        worst_y, worst_s = max(worst_y, ey), max(worst_s, es)
        state = got_s.copy()  # continue both from the GPU's state so errors do not compound across steps
    record(f"gdn_decode_step{list(shape)}", y_max_rel=worst_y, state_rel=worst_s, seed=seed)


def test_gdn_decode_step_rejects_bad_arguments() -> None:
    z = cp.zeros
    state = z((4, 16, 32), cp.float32)
    args = [z(2 * 2 * 16 + 4 * 32, cp.float32), z((3, 192), cp.float32), z((192, 4), cp.float32)]
    heads = [z(4, cp.float32) for _ in range(4)]
    with pytest.raises(ValueError, match="num_k_heads"):
        gs.gdn_decode_step(*args, *heads, z(128, cp.float32), z(32, cp.float32), state, 3, 1e-6)
    with pytest.raises(ValueError, match="mixed"):
        gs.gdn_decode_step(z(10, cp.float32), *args[1:], *heads, z(128, cp.float32), z(32, cp.float32), state, 2,
                           1e-6)
    with pytest.raises(ValueError, match="dv"):
        gs.gdn_decode_step(*args, *heads, z(128, cp.float32), z(32, cp.float32), z((4, 16, 24), cp.float32), 2,
                           1e-6)
