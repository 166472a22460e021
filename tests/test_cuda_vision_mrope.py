"""CUDA image-prompt rotary prep (cuda/vision_mrope.cu) and the attention launchers' image keywords (``mrope=`` on
the prefills, ``rope_shift=`` on decode and verify) against the NumPy references, on fresh random inputs.

Checks:
- attn_prep_rows_mrope: q and the written k rows within relative 1e-5 of vision_mrope.reference (3-D positions, the
  interleaved sections of the 27B (11, 11, 10) and of the test checkpoints (3, 3, 2)); v rows copied exactly; rows
  outside dst_row0..+T untouched (NaN-poisoned caches and a NaN-poisoned q); fp32 and bf16 caches;
- rows whose three positions are equal: the bits of attn_prep_rows at that position (q and the cache rows), so a text
  row of an image prompt is a text prompt's row;
- attention_prefill_step(mrope=) within 1e-4 of vision_mrope.reference_prefill; with equal positions start + t, the
  bits of the text call; attention_flash_prefill(mrope=) with equal positions: the text call's bits, and 3-D positions
  within the flash kernel's bf16 bound (2e-2) of the reference;
- attention_decode_step(rope_shift=s) within 1e-5 of attention_decode.reference_step(rope_shift=s); DecodeStep at
  (pos, s) the same bits; attention_tree_step(rope_shift=s) node rows equal, bit for bit, decodes of their paths with
  the same shift (speculative == plain after an image).
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import attention_flash as af  # noqa: E402
from tandem.backend.cuda import attention_tree as at  # noqa: E402
from tandem.backend.cuda import vision_mrope as vm  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (H, Hkv, D, rotary dims, mrope_section): the test checkpoints' attention and Qwen3.5-27B's
SHAPES = [(4, 2, 64, 16, (3, 3, 2)), (24, 4, 256, 64, (11, 11, 10))]
THETA, EPS, MAX_LEN = 1e7, 1e-6, 1024


def _inputs(rng: np.random.Generator, shape: tuple[Any, ...], rows: int) -> dict[str, np.ndarray]:
    h, hkv, d = shape[:3]

    def f32(*s: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(s) * scale).astype(np.float32)

    return {"qg": f32(rows, h, 2 * d), "k_new": f32(rows, hkv, d), "v_new": f32(rows, hkv, d),
            "q_norm": (1.0 + f32(d, scale=0.1)).astype(np.float32),
            "k_norm": (1.0 + f32(d, scale=0.1)).astype(np.float32)}


def _positions(rng: np.random.Generator, rows: int, first: int) -> np.ndarray:
    """An image prompt's rows: text, an image block of 3-D positions, text (positions as mrope.mrope_positions)."""
    pos = np.empty((rows, 3), np.int64)
    a = rows // 4
    pos[:a] = (first + np.arange(a))[:, None]
    gh, gw = 4, (rows // 2) // 4
    tt, rr, cc = np.meshgrid([0], np.arange(gh), np.arange(gw), indexing="ij")
    s = first + a
    pos[a:a + gh * gw] = np.stack([s + tt.reshape(-1), s + rr.reshape(-1), s + cc.reshape(-1)], axis=1)
    rest = rows - a - gh * gw
    pos[a + gh * gw:] = (s + max(gh, gw) + np.arange(rest))[:, None]
    return pos


def _caches(hkv: int, d: int, bf16: bool) -> tuple[Any, Any]:
    if bf16:
        return cp.full((MAX_LEN, hkv, d), 0xFFFF, dtype=cp.uint16), cp.full((MAX_LEN, hkv, d), 0xFFFF, dtype=cp.uint16)
    return cp.full((MAX_LEN, hkv, d), np.nan, dtype=cp.float32), cp.full((MAX_LEN, hkv, d), np.nan, dtype=cp.float32)


def _f32(rows: np.ndarray) -> np.ndarray:
    return bf16_to_f32(rows) if rows.dtype == np.uint16 else rows


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["small", "27b"])
def test_prep_matches_the_reference(shape: tuple[Any, ...], bf16: bool) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd, section = shape
    t, row0 = 40, 100
    x = _inputs(rng, shape, t)
    pos = _positions(rng, t, 37)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    kc, vc = _caches(hkv, d, bf16)
    q = vm.mrope_prep(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"],
                      cp.asarray(ad.inv_freq(rd, THETA)), vm.MRopeRows.upload(pos, section), kc, vc, row0, EPS)
    ref_q, ref_k, _ = vm.reference(x["qg"], x["k_new"], x["q_norm"], x["k_norm"], pos, rd, THETA, section, EPS)
    got_q, got_k = cp.asnumpy(q), _f32(cp.asnumpy(kc))
    q_err, k_err = max_rel_error(got_q, ref_q), max_rel_error(got_k[row0:row0 + t], ref_k)
    bound = 1e-2 if bf16 else 1e-5  # bf16 rows: the storage's rounding
    assert q_err <= 1e-5 and k_err <= bound, f"{shape} seed={seed}: q {q_err:.3g}, k {k_err:.3g}"
    want_v = bf16_to_f32(f32_to_bf16(x["v_new"])) if bf16 else x["v_new"]
    np.testing.assert_array_equal(_f32(cp.asnumpy(vc))[row0:row0 + t], want_v)
    if not bf16:
        assert np.isnan(got_k[:row0]).all() and np.isnan(got_k[row0 + t:]).all(), "rows outside were written"
    else:
        raw = cp.asnumpy(kc)
        assert (raw[:row0] == 0xFFFF).all() and (raw[row0 + t:] == 0xFFFF).all(), "rows outside were written"
    record(f"vision_mrope{list(shape[:4])}[{'bf16' if bf16 else 'fp32'}]", q_max_rel=q_err, k_max_rel=k_err,
           seed=seed)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["small", "27b"])
def test_equal_positions_give_the_text_prep_bits(shape: tuple[Any, ...], bf16: bool) -> None:
    rng = np.random.default_rng(secrets.randbits(32))
    h, hkv, d, rd, section = shape
    t, start = 70, 300
    x = {k: cp.asarray(v) for k, v in _inputs(rng, shape, t).items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    pos = np.repeat((start + np.arange(t))[:, None], 3, axis=1)
    kc, vc = _caches(hkv, d, bf16)
    kc2, vc2 = _caches(hkv, d, bf16)
    q = vm.mrope_prep(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], freq,
                      vm.MRopeRows.upload(pos, section), kc, vc, start, EPS)
    q_text = at._prep(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], freq, None, kc2, vc2, start, start,
                      EPS)
    assert np.array_equal(cp.asnumpy(q).view(np.uint32), cp.asnumpy(q_text).view(np.uint32))
    assert np.array_equal(cp.asnumpy(kc).view(np.uint8), cp.asnumpy(kc2).view(np.uint8))
    assert np.array_equal(cp.asnumpy(vc).view(np.uint8), cp.asnumpy(vc2).view(np.uint8))


@pytest.mark.parametrize("start", [0, 130])
@pytest.mark.parametrize("shape", SHAPES, ids=["small", "27b"])
def test_prefills_with_positions(shape: tuple[Any, ...], start: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd, section = shape
    t = 96
    x = _inputs(rng, shape, t)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    past_k = rng.standard_normal((start, hkv, d)).astype(np.float32)
    past_v = rng.standard_normal((start, hkv, d)).astype(np.float32)

    def caches() -> tuple[Any, Any]:
        kc, vc = _caches(hkv, d, False)
        kc[:start], vc[:start] = cp.asarray(past_k), cp.asarray(past_v)
        return kc, vc

    pos = _positions(rng, t, max(0, start - 20))
    rows = vm.MRopeRows.upload(pos, section)
    kc, vc = caches()
    y = cp.full((t, h * d), np.nan, dtype=cp.float32)
    at.attention_prefill_step(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], freq, kc, vc,
                              start, EPS, out=y, mrope=rows)
    rk, rv = np.full((MAX_LEN, hkv, d), np.nan, np.float32), np.full((MAX_LEN, hkv, d), np.nan, np.float32)
    rk[:start], rv[:start] = past_k, past_v
    ref = vm.reference_prefill(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], rd, THETA, section, pos,
                               rk, rv, start, EPS)
    err = max_rel_error(cp.asnumpy(y), ref)
    assert err <= 1e-4, f"exact prefill {shape} start={start} seed={seed}: {err:.3g}"
    kc_f, vc_f = caches()
    yf = af.attention_flash_prefill(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], freq, kc_f,
                                    vc_f, start, EPS, mrope=rows)
    flash_err = rel_error(cp.asnumpy(yf), ref)
    assert flash_err <= 2e-2, f"flash prefill {shape} start={start} seed={seed}: {flash_err:.3g}"
    # equal positions start + t: the text calls' bits, both prefills
    flat = vm.MRopeRows.upload(np.repeat((start + np.arange(t))[:, None], 3, axis=1), section)
    for fn in (at.attention_prefill_step, af.attention_flash_prefill):
        (ka, va), (kb, vb) = caches(), caches()
        a = fn(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], freq, ka, va, start, EPS,
               mrope=flat)
        b = fn(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], freq, kb, vb, start, EPS)
        assert np.array_equal(cp.asnumpy(a).view(np.uint32), cp.asnumpy(b).view(np.uint32)), fn.__name__
        assert np.array_equal(cp.asnumpy(ka).view(np.uint32), cp.asnumpy(kb).view(np.uint32)), fn.__name__
    record(f"vision_mrope_prefill{list(shape[:4])}[P={start}]", exact_max_rel=err, flash_rel=flash_err, seed=seed)


@pytest.mark.parametrize("start", [5, 200])
@pytest.mark.parametrize("shape", SHAPES, ids=["small", "27b"])
def test_shifted_decode_and_verify(shape: tuple[Any, ...], start: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd, _ = shape
    shift = -min(start, 37)
    parents = [-1, 0, 1, 2, 1, 0, 5, 3]
    n = len(parents)
    x = _inputs(rng, shape, n)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    past = rng.standard_normal((2, start, hkv, d)).astype(np.float32)
    kc, vc = cp.zeros((MAX_LEN, hkv, d), cp.float32), cp.zeros((MAX_LEN, hkv, d), cp.float32)
    kc[:start], vc[:start] = cp.asarray(past[0]), cp.asarray(past[1])
    # one decode against the reference
    y = cp.full((h * d,), np.nan, dtype=cp.float32)
    k1, v1 = kc.copy(), vc.copy()
    ad.attention_decode_step(dev["qg"][0], dev["k_new"][0], dev["v_new"][0], dev["q_norm"], dev["k_norm"], freq, k1,
                             v1, start, EPS, out=y, rope_shift=shift)
    rk, rv = cp.asnumpy(kc), cp.asnumpy(vc)
    ref = ad.reference_step(x["qg"][0], x["k_new"][0], x["v_new"][0], x["q_norm"], x["k_norm"], rd, THETA, rk, rv,
                            start, EPS, rope_shift=shift)
    err = max_rel_error(cp.asnumpy(y), ref)
    assert err <= 1e-5, f"shifted decode {shape} seed={seed}: {err:.3g}"
    ref0 = ad.reference_step(x["qg"][0], x["k_new"][0], x["v_new"][0], x["q_norm"], x["k_norm"], rd, THETA,
                             cp.asnumpy(kc), cp.asnumpy(vc), start, EPS)
    assert max_rel_error(cp.asnumpy(y), ref0) > 1e-4, "the shift changed nothing"
    # DecodeStep at (pos, shift): the same bits
    k2, v2 = kc.copy(), vc.copy()
    step = ad.DecodeStep(dev["qg"][0], dev["k_new"][0], dev["v_new"][0], dev["q_norm"], dev["k_norm"], freq, k2, v2,
                         EPS)
    step(start, shift)
    assert np.array_equal(cp.asnumpy(step.result).view(np.uint32), cp.asnumpy(y).view(np.uint32))
    assert np.array_equal(cp.asnumpy(k2[start]).view(np.uint32), cp.asnumpy(k1[start]).view(np.uint32))
    # verify rows == decodes of their paths, with the same shift
    node_k = cp.empty((n, hkv, d), dtype=cp.float32)
    node_v = cp.empty((n, hkv, d), dtype=cp.float32)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    rows = cp.asnumpy(at.attention_tree_step(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"],
                                             freq, kc, vc, start, depths, parents, EPS, node_k, node_v,
                                             rope_shift=shift))
    for i in range(n):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        kp, vp = kc.copy(), vc.copy()
        at.attention_commit(kp, vp, node_k, node_v, start, path[::-1][:-1])
        pos = start + len(path) - 1
        row = ad.attention_decode_step(dev["qg"][i], dev["k_new"][i], dev["v_new"][i], dev["q_norm"], dev["k_norm"],
                                       freq, kp, vp, pos, EPS, rope_shift=shift)
        assert np.array_equal(cp.asnumpy(row).view(np.uint32), rows[i].view(np.uint32)), f"node {i} seed={seed}"
        assert np.array_equal(cp.asnumpy(kp[pos]), cp.asnumpy(node_k[i])), f"node {i}: k row differs from decode's"
    record(f"vision_mrope_shift{list(shape[:4])}[P={start}]", decode_max_rel=err, seed=seed)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positions"):
        vm.MRopeRows.upload(np.zeros((4, 2), np.int64), (1, 1, 1))
    with pytest.raises(ValueError, match="section"):
        vm.MRopeRows.upload(np.zeros((4, 3), np.int64), (1, 1))
    rng = np.random.default_rng(0)
    x = {k: cp.asarray(v) for k, v in _inputs(rng, SHAPES[0], 4).items()}
    kc, vc = _caches(2, 64, False)
    with pytest.raises(ValueError, match="positions"):  # 4 rows, 5 positions
        vm.mrope_prep(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], cp.asarray(ad.inv_freq(16, THETA)),
                      vm.MRopeRows.upload(np.zeros((5, 3), np.int64), (3, 3, 2)), kc, vc, 0, EPS)
