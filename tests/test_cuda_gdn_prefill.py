"""The prefill chunk's GDN scan (cuda/gdn_prefill.cu, tandem/backend/cuda/gdn_prefill.py) vs the NumPy reference,
on fresh random inputs.

Checks: y within relative 1e-4 and the state within 1e-4 of reference_prefill (the recurrent form in NumPy), the conv
tail bitwise, for every scan variant (state rows a lane) of every key head size, chunks of 1 to 300 tokens (the tail
shift of chunks shorter than the tail too); a NaN-poisoned y fully written; chunk invariance: the same tokens in one
call or in calls cut anywhere give the same y, state and tail bit for bit; a 4096-token chunk; the split operand
equals bf16(y); ValueError on bad arguments.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import gdn_prefill as gp  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import f32_to_bf16  # noqa: E402
from gdn_layer import Layer  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

EPS = 1e-6
# (Hk, Hv, dk, dv, K): the embedded default model's GDN, Qwen3.5-27B's, and the other key head sizes
SHAPES = [(4, 8, 64, 64, 4), (16, 48, 128, 128, 4), (4, 8, 32, 64, 4), (2, 4, 256, 128, 4), (2, 2, 128, 64, 2)]
CASES = [(shape, r) for shape in SHAPES for r in gp.VARIANTS[shape[2]]
         if shape[3] % gp.columns_a_block(shape[2], r) == 0]


def _run(ly: Layer, toks: tuple[np.ndarray, ...], tail: Any, state: Any, r: int, split: str | None = None) -> Any:
    mixed, a, b, z = (cp.asarray(t) for t in toks)
    y = cp.full((mixed.shape[0], ly.shape[1] * ly.shape[3]), np.nan, dtype=cp.float32)
    return gp.gdn_prefill_chunk(mixed, tail, ly.dev[0], a, b, ly.dev[1], ly.dev[2], z, ly.dev[3], state, ly.shape[0],
                                EPS, out=y, rows_per_lane=r, split=split)


@pytest.mark.parametrize("num_tokens", [1, 2, 33, 300])
@pytest.mark.parametrize("shape,r", CASES)
def test_scan_matches_the_reference(shape: tuple[int, int, int, int, int], r: int, num_tokens: int) -> None:
    seed = secrets.randbits(32)
    ly = Layer(np.random.default_rng(seed), shape)
    toks = ly.tokens(num_tokens)
    tail_d, state_d = cp.asarray(ly.tail), cp.asarray(ly.state)
    got = cp.asnumpy(_run(ly, toks, tail_d, state_d, r))
    tail, state = ly.tail.copy(), ly.state.copy()
    ref = gp.reference(toks[0], tail, ly.conv_w, toks[1], toks[2], ly.a_log, ly.dt_bias, toks[3], ly.norm_w, state,
                       shape[0], EPS)
    ey = max(rel_error(got, ref), max_rel_error(got, ref))
    es = rel_error(cp.asnumpy(state_d), state)
    assert ey <= 1e-4 and es <= 1e-4, f"{shape} r={r} T={num_tokens} seed={seed}: y {ey:.3g}, state {es:.3g}"
    assert np.array_equal(cp.asnumpy(tail_d), tail), f"{shape} r={r} T={num_tokens} seed={seed}: conv tail"
    record(f"gdn_prefill_chunk{list(shape)}r{r}", tokens=num_tokens, y_max_rel=ey, state_rel=es, seed=seed)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_chunks_cut_anywhere_give_the_same_bits(shape: tuple[int, int, int, int, int]) -> None:
    ly = Layer(np.random.default_rng(secrets.randbits(32)), shape)
    toks = ly.tokens(200)
    tail_w, state_w = cp.asarray(ly.tail), cp.asarray(ly.state)
    want = cp.asnumpy(_run(ly, toks, tail_w, state_w, gp.DEFAULT_ROWS[shape[2]]))
    for cuts in ([1], [2, 3], [31, 32, 33], [150, 199]):
        tail_c, state_c = cp.asarray(ly.tail), cp.asarray(ly.state)
        edges = [0, *cuts, 200]
        got = np.concatenate([cp.asnumpy(_run(ly, tuple(t[a:b] for t in toks), tail_c, state_c,
                                               gp.DEFAULT_ROWS[shape[2]])) for a, b in zip(edges, edges[1:])])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), cuts
        assert cp.array_equal(state_c, state_w) and cp.array_equal(tail_c, tail_w), cuts


def test_a_long_chunk_matches_the_reference() -> None:
    seed = secrets.randbits(32)
    shape = SHAPES[1]
    ly = Layer(np.random.default_rng(seed), shape)
    toks = ly.tokens(4096)
    tail_d, state_d = cp.asarray(ly.tail), cp.asarray(ly.state)
    got = cp.asnumpy(_run(ly, toks, tail_d, state_d, gp.DEFAULT_ROWS[128]))
    tail, state = ly.tail.copy(), ly.state.copy()
    ref = gp.reference(toks[0], tail, ly.conv_w, toks[1], toks[2], ly.a_log, ly.dt_bias, toks[3], ly.norm_w, state,
                       shape[0], EPS)
    assert rel_error(got, ref) <= 1e-4 and rel_error(cp.asnumpy(state_d), state) <= 1e-4, f"seed {seed}"


def test_split_operand_is_bf16_of_y() -> None:
    ly = Layer(np.random.default_rng(secrets.randbits(32)), SHAPES[0])
    toks = ly.tokens(40)
    y = cp.asnumpy(_run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state), 8))
    xs = cp.asnumpy(_run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state), 8, split="b16"))
    np.testing.assert_array_equal(xs[:, 0], f32_to_bf16(y))


def test_bad_arguments_raise() -> None:
    ly = Layer(np.random.default_rng(0), SHAPES[0])
    toks = ly.tokens(4)
    with pytest.raises(ValueError):
        _run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state), 32)  # no 64r32 variant
    with pytest.raises(ValueError):
        _run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state)[:, :, :32], 8)  # state of another dv
