"""The chunked GDN scan on tensor cores (cuda/gdn_chunk.cu through gdn_prefill.gdn_prefill_chunk(scan="chunked"))
vs its NumPy twin and the recurrent reference, on fresh random inputs.

Checks: y and the state within relative 1e-4 ("3xtf32") / 3e-3 ("tf32") of gdn_seq.reference_prefill and of the
twin (gdn_chunk.reference), the conv tail bitwise, for calls of 1 to 300 tokens from a grid position and off it
(start % 64 ≠ 0), at the embedded model's, the 27B's and dk 32's shapes; a NaN-poisoned y fully written; a 4,096-token
call at the 27B shape and a 32,768-token call (2 heads of 128) against the reference; chunk invariance on the device:
300 tokens in one call or in calls cut at multiples of 64 (a partial last chunk included) give the same y, state and
tail bit for bit, and a repeated call the same bits; the split operand equals bf16(y); ValueError on bad arguments.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import gdn_chunk as gc  # noqa: E402
from tandem.backend.cuda import gdn_prefill as gp  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import f32_to_bf16  # noqa: E402
from gdn_layer import Layer  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

EPS = 1e-6
TOL = {"3xtf32": 1e-4, "tf32": 3e-3}
# (Hk, Hv, dk, dv, K): the embedded default model's GDN, Qwen3.5-27B's, dk 32, dv two column blocks
SHAPES = [(4, 8, 64, 64, 4), (16, 48, 128, 128, 4), (2, 4, 32, 64, 4), (1, 2, 128, 128, 2)]


def _slow(ly: Layer) -> Layer:
    """Heads that remember ~10-100 tokens (the layer's own decay forgets within a few), so chunks interact."""
    ly.a_log = np.log(ly.rng.uniform(0.01, 0.1, ly.shape[1])).astype(np.float32)
    ly.dev[1] = cp.asarray(ly.a_log)
    return ly


def _run(ly: Layer, toks: tuple[np.ndarray, ...], tail: Any, state: Any, start: int, precision: str,
         split: str | None = None) -> Any:
    mixed, a, b, z = (cp.asarray(t) for t in toks)
    y = cp.full((mixed.shape[0], ly.shape[1] * ly.shape[3]), np.nan, dtype=cp.float32)
    return gp.gdn_prefill_chunk(mixed, tail, ly.dev[0], a, b, ly.dev[1], ly.dev[2], z, ly.dev[3], state, ly.shape[0],
                                EPS, out=y, split=split, scan="chunked", start=start, precision=precision)


def _check(ly: Layer, toks: tuple[np.ndarray, ...], start: int, precision: str, seed: int) -> dict[str, float]:
    tail_d, state_d = cp.asarray(ly.tail), cp.asarray(ly.state)
    got = cp.asnumpy(_run(ly, toks, tail_d, state_d, start, precision))
    tail, state = ly.tail.copy(), ly.state.copy()
    ref = gp.reference(toks[0], tail, ly.conv_w, toks[1], toks[2], ly.a_log, ly.dt_bias, toks[3], ly.norm_w, state,
                       ly.shape[0], EPS)
    tail_t, state_t = ly.tail.copy(), ly.state.copy()
    twin = gc.reference(toks[0], tail_t, ly.conv_w, toks[1], toks[2], ly.a_log, ly.dt_bias, toks[3], ly.norm_w,
                        state_t, ly.shape[0], EPS, start, precision)
    figures = {"y_rel": rel_error(got, ref), "y_max_rel": max_rel_error(got, ref),
               "state_rel": rel_error(cp.asnumpy(state_d), state), "y_twin_rel": rel_error(got, twin),
               "state_twin_rel": rel_error(cp.asnumpy(state_d), state_t)}
    tol = TOL[precision]
    assert max(figures.values()) <= tol, f"{ly.shape} T={toks[0].shape[0]} start={start} {precision} seed={seed}: " \
        f"{figures}"
    assert np.array_equal(cp.asnumpy(tail_d), tail), f"seed {seed}: conv tail"
    return figures


@pytest.mark.parametrize("precision", sorted(gc.PRECISIONS))
@pytest.mark.parametrize("num_tokens,start", [(1, 0), (2, 0), (64, 0), (65, 0), (300, 0), (1, 63), (100, 37),
                                              (300, 128)])
@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_scan_matches_the_reference_and_twin(shape: tuple[int, int, int, int, int], num_tokens: int,
                                                     start: int, precision: str) -> None:
    seed = secrets.randbits(32)
    ly = _slow(Layer(np.random.default_rng(seed), shape))
    figures = _check(ly, ly.tokens(num_tokens), start, precision, seed)
    record(f"gdn_chunk{list(shape)}{precision}", tokens=num_tokens, start=start, seed=seed, **figures)


@pytest.mark.parametrize("precision", sorted(gc.PRECISIONS))
@pytest.mark.parametrize("num_tokens,shape", [(4096, SHAPES[1]), (32768, SHAPES[3])])
def test_long_calls_match_the_reference(num_tokens: int, shape: tuple[int, int, int, int, int],
                                        precision: str) -> None:
    seed = secrets.randbits(32)
    ly = _slow(Layer(np.random.default_rng(seed), shape))
    figures = _check(ly, ly.tokens(num_tokens), 0, precision, seed)
    record(f"gdn_chunk_long{list(shape)}{precision}", tokens=num_tokens, seed=seed, **figures)


@pytest.mark.parametrize("precision", sorted(gc.PRECISIONS))
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_cuts_on_the_grid_give_the_same_bits(shape: tuple[int, int, int, int, int], precision: str) -> None:
    ly = _slow(Layer(np.random.default_rng(secrets.randbits(32)), shape))
    toks = ly.tokens(300)
    tail_w, state_w = cp.asarray(ly.tail), cp.asarray(ly.state)
    want = cp.asnumpy(_run(ly, toks, tail_w, state_w, 0, precision))
    for cuts in ([], [64], [64, 192], [128, 256], [64, 128, 192, 256]):
        tail_c, state_c = cp.asarray(ly.tail), cp.asarray(ly.state)
        edges = [0, *cuts, 300]
        got = np.concatenate([cp.asnumpy(_run(ly, tuple(t[a:b] for t in toks), tail_c, state_c, a, precision))
                              for a, b in zip(edges, edges[1:])])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), cuts
        assert cp.array_equal(state_c.view(cp.uint32), state_w.view(cp.uint32)), cuts
        assert cp.array_equal(tail_c, tail_w), cuts


def test_split_operand_is_bf16_of_y() -> None:
    ly = Layer(np.random.default_rng(secrets.randbits(32)), SHAPES[0])
    toks = ly.tokens(100)
    y = cp.asnumpy(_run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state), 0, gc.DEFAULT_PRECISION))
    xs = cp.asnumpy(_run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state), 0, gc.DEFAULT_PRECISION, split="b16"))
    np.testing.assert_array_equal(xs[:, 0], f32_to_bf16(y))


def test_bad_arguments_raise() -> None:
    ly = Layer(np.random.default_rng(0), SHAPES[0])
    toks = ly.tokens(4)
    with pytest.raises(ValueError):
        _run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state), 0, "fp16")
    with pytest.raises(ValueError):
        _run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state), -1, "tf32")
    with pytest.raises(ValueError):
        _run(ly, toks, cp.asarray(ly.tail), cp.asarray(ly.state)[:, :, :32], 0, "tf32")  # dv 32: not a column block
    ly2 = Layer(np.random.default_rng(0), (2, 4, 256, 128, 4))
    with pytest.raises(ValueError):
        _run(ly2, ly2.tokens(4), cp.asarray(ly2.tail), cp.asarray(ly2.state), 0, "tf32")  # dk 256
    with pytest.raises(ValueError):
        mixed, a, b, z = (cp.asarray(t) for t in toks)
        small = gc.new_workspace(64, 8, 64, 64)
        gp.gdn_prefill_chunk(mixed, cp.asarray(ly.tail), ly.dev[0], a, b, ly.dev[1], ly.dev[2], z, ly.dev[3],
                             cp.asarray(ly.state), 4, EPS, scan="chunked", start=0,
                             workspace=small._replace(num_chunks=0))
