"""CUDA attention decode (cuda/attention_decode.cu) vs numpy_ops on fresh random inputs: the plain op, and the
full step (q/k RMSNorm, partial RoPE, cache append, GQA attention over 64-row absolute chunks, output gate).

Checks: relative error ≤ 1e-5, NaN-poisoned outputs fully written, cache rows written at `pos` (v bitwise),
positions on both sides of chunk boundaries, ValueError on bad arguments, for the fused single launch (the
default) and the two-launch path (fused=False); the split output (split="f16" / "f16p" / "bf16": the combine
writes the o projection's GEMV operand) equal bit for bit to gemv.prepare of the fp32 output, on NaN-poisoned
(0xFFFF) operands; the fused launch equal bit for bit to the two launches (y, every split, cache rows) at one
chunk, the first row of a new chunk and long rows, over consecutive calls of several shapes sharing the counter
(left zeroed after every launch, grown for more KV heads than it had).
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import gemv  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (H, Hkv, D, rotary dims): the embedded default model's attention and Qwen3.5-9B's / 27B's
SHAPES = [(6, 2, 64, 16), (16, 4, 256, 64), (24, 4, 256, 64)]
TOL = 1e-5
SPLITS = ["f16", "f16p", "bf16"]
POISON = 0xFFFF  # fp16 / bf16 NaN bits: a finite value never splits to them


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 256, 257, 1000])
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_decode(shape: tuple[int, int, int, int], rows: int, fused: bool) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, _ = shape
    q = rng.standard_normal((h, d)).astype(np.float32)
    keys = rng.standard_normal((rows, hkv, d)).astype(np.float32)
    values = rng.standard_normal((rows, hkv, d)).astype(np.float32)
    y = cp.full((h, d), np.nan, dtype=cp.float32)
    ad.attention_decode(cp.asarray(q), cp.asarray(keys), cp.asarray(values), out=y, fused=fused)
    got, ref = cp.asnumpy(y), ad.reference(q, keys, values)
    assert np.isfinite(got).all(), f"{shape} rows={rows} fused={fused} seed={seed}: y not fully written"
    err, merr = rel_error(got, ref), max_rel_error(got, ref)
    assert err <= TOL and merr <= TOL, \
        f"{shape} rows={rows} fused={fused} seed={seed}: rel {err:.3g} max rel {merr:.3g}"
    record(f"attention_decode{list(shape)}[S={rows},fused={fused}]", rel=err, max_rel=merr, seed=seed)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("pos", [0, 1, 63, 64, 255, 256, 700, 4000])
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_decode_step(shape: tuple[int, int, int, int], pos: int, fused: bool) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    theta, eps, max_len = 1e7, 1e-6, 4096

    def f32(*s: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(s) * scale).astype(np.float32)

    k_cache = np.full((max_len, hkv, d), np.nan, dtype=np.float32)
    v_cache = k_cache.copy()
    k_cache[:pos], v_cache[:pos] = f32(pos, hkv, d), f32(pos, hkv, d)
    qg, k_new, v_new = f32(h, 2 * d), f32(hkv, d), f32(hkv, d)
    q_norm, k_norm = (1.0 + f32(d, scale=0.1)).astype(np.float32), (1.0 + f32(d, scale=0.1)).astype(np.float32)
    kc, vc = cp.asarray(k_cache), cp.asarray(v_cache)
    y = cp.full((h * d,), np.nan, dtype=cp.float32)
    assert ad.attention_decode_step(
        cp.asarray(qg), cp.asarray(k_new), cp.asarray(v_new), cp.asarray(q_norm), cp.asarray(k_norm),
        cp.asarray(ad.inv_freq(rd, theta)), kc, vc, pos, eps, out=y, fused=fused) is y
    got = cp.asnumpy(y)
    assert np.isfinite(got).all(), f"{shape} pos={pos} fused={fused} seed={seed}: y not fully written"
    ref = ad.reference_step(qg, k_new, v_new, q_norm, k_norm, rd, theta, k_cache, v_cache, pos, eps)
    err, merr = rel_error(got, ref), max_rel_error(got, ref)
    k_err = max_rel_error(cp.asnumpy(kc[pos]), k_cache[pos])
    assert err <= TOL and merr <= TOL, \
        f"{shape} pos={pos} fused={fused} seed={seed}: rel {err:.3g} max rel {merr:.3g}"
    assert k_err <= 1e-6, f"{shape} pos={pos}: k row {k_err:.3g}"
    assert np.array_equal(cp.asnumpy(vc[pos]), v_cache[pos]), "v row must be copied exactly"
    assert np.isnan(cp.asnumpy(kc[pos + 1:])).all(), "cache rows after pos must stay untouched"
    record(f"attention_decode_step{list(shape)}[pos={pos},fused={fused}]", rel=err, max_rel=merr,
           k_row_max_rel=k_err, seed=seed)


def _step_inputs(rng: np.random.Generator, shape: tuple[int, int, int, int], pos: int) -> tuple[object, ...]:
    """Device arguments of attention_decode_step (qg .. v_cache) with random cache rows [0, pos)."""
    h, hkv, d, rd = shape
    k_cache = cp.full((4096, hkv, d), np.nan, dtype=cp.float32)
    v_cache = k_cache.copy()
    k_cache[:pos] = cp.asarray(rng.standard_normal((pos, hkv, d)).astype(np.float32))
    v_cache[:pos] = cp.asarray(rng.standard_normal((pos, hkv, d)).astype(np.float32))
    dev = [cp.asarray(rng.standard_normal(s).astype(np.float32)) for s in [(h, 2 * d), (hkv, d), (hkv, d)]]
    norms = [cp.asarray((1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)) for _ in range(2)]
    return (*dev, *norms, cp.asarray(ad.inv_freq(rd, 1e7)), k_cache, v_cache)


@pytest.mark.parametrize("pos", [0, 100, 700])
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_decode_step_split(shape: tuple[int, int, int, int], split: str, pos: int) -> None:
    """split=kind writes xs [1, P, H·D] == gemv.prepare(y, kind) bitwise, y from the unsplit call."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, _ = shape
    args = _step_inputs(rng, shape, pos)
    y = cp.full((h * d,), np.nan, dtype=cp.float32)
    assert ad.attention_decode_step(*args, pos, 1e-6, out=y) is y  # written in place
    got_y = cp.asnumpy(y)
    assert np.isfinite(got_y).all(), f"{shape} pos={pos} seed={seed}: y not fully written"
    want = cp.asnumpy(gemv.prepare(y.reshape(1, -1), split))
    xs = cp.full((1, gemv.PARTS[split], h * d), POISON, dtype=cp.uint16)
    assert ad.attention_decode_step(*args, pos, 1e-6, split=split, xs=xs) is xs
    assert np.array_equal(cp.asnumpy(xs), want), f"{shape} {split} pos={pos} seed={seed}: xs != prepare(y)"
    fresh = ad.attention_decode_step(*args, pos, 1e-6, split=split)  # allocated by the launcher
    assert fresh.dtype == cp.uint16 and fresh.shape == (1, gemv.PARTS[split], h * d)
    assert np.array_equal(cp.asnumpy(fresh), want), f"{shape} {split} pos={pos} seed={seed}: allocated xs"


def _bits(a: Any) -> np.ndarray:
    """Host copy of a device array as raw bits (float32 -> uint32), so -0 / +0 and NaN payloads count."""
    host = cp.asnumpy(a)
    return host.view(np.uint32) if host.dtype == np.float32 else host


def _step_fused_vs_two(args: tuple[Any, ...], pos: int, tag: str) -> None:
    """attention_decode_step at `pos` fused and in two launches, on separate copies of the caches in `args`: y
    (NaN-poisoned), each split's xs (0xFFFF-poisoned) and both caches equal bit for bit; y fully written. The
    caches in `args` end as the fused calls leave them (row `pos` written)."""
    *inputs, kc, vc = args
    h, d = int(inputs[0].shape[0]), int(inputs[0].shape[1]) // 2
    kc2, vc2 = kc.copy(), vc.copy()
    y1, y2 = (cp.full((h * d,), np.nan, dtype=cp.float32) for _ in range(2))
    ad.attention_decode_step(*inputs, kc, vc, pos, 1e-6, out=y1)
    ad.attention_decode_step(*inputs, kc2, vc2, pos, 1e-6, out=y2, fused=False)
    assert np.isfinite(cp.asnumpy(y1)).all(), f"{tag}: fused y not fully written"
    assert np.array_equal(_bits(y1), _bits(y2)), f"{tag}: fused y != two-launch y"
    assert np.array_equal(_bits(kc), _bits(kc2)) and np.array_equal(_bits(vc), _bits(vc2)), f"{tag}: caches differ"
    for split in SPLITS:
        x1, x2 = (cp.full((1, gemv.PARTS[split], h * d), POISON, dtype=cp.uint16) for _ in range(2))
        ad.attention_decode_step(*inputs, kc, vc, pos, 1e-6, split=split, xs=x1)
        ad.attention_decode_step(*inputs, kc2, vc2, pos, 1e-6, split=split, xs=x2, fused=False)
        assert np.array_equal(_bits(x1), _bits(x2)), f"{tag} {split}: fused xs != two-launch xs"
        assert np.array_equal(_bits(x1), _bits(gemv.prepare(y2.reshape(1, -1), split))), f"{tag} {split}: xs"
    assert np.array_equal(_bits(kc), _bits(kc2)) and np.array_equal(_bits(vc), _bits(vc2)), f"{tag}: caches differ"


# 0, 5: one chunk; 64, 128, 4032: the first row of a new chunk; 63, 700, 4095: ends of / inside longer runs
@pytest.mark.parametrize("pos", [0, 5, 63, 64, 128, 700, 4032, 4095])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_two_launches(shape: tuple[int, int, int, int], pos: int) -> None:
    """The single fused launch gives the bits of attn_partial + attn_combine: y, every split, the caches."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    _step_fused_vs_two(_step_inputs(rng, shape, pos), pos, f"{shape} pos={pos} seed={seed}")
    assert not cp.asnumpy(ad.counter(1)).any(), f"{shape} pos={pos}: counter not left zeroed"


def test_fused_consecutive_calls() -> None:
    """Consecutive fused launches of shapes with different KV head counts share the counter, which each leaves
    zeroed: every call (decode positions crossing chunk boundaries, one cache per shape) keeps the two-launch
    bits; a launch with more KV heads than the counter holds grows it."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    caches = {shape: _step_inputs(rng, shape, 130)[6:] for shape in SHAPES}  # random rows [0, 130)
    for pos in [60, 61, 62, 63, 64, 65, 127, 128]:
        for shape, (kc, vc) in caches.items():
            h, hkv, d, rd = shape
            fresh = [cp.asarray(rng.standard_normal(s).astype(np.float32)) for s in [(h, 2 * d), (hkv, d), (hkv, d)]]
            norms = [cp.asarray((1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)) for _ in range(2)]
            args = (*fresh, *norms, cp.asarray(ad.inv_freq(rd, 1e7)), kc, vc)  # new inputs, the same caches
            _step_fused_vs_two(args, pos, f"{shape} pos={pos} seed={seed}")
            assert not cp.asnumpy(ad.counter(1)).any(), f"{shape} pos={pos} seed={seed}: counter not zeroed"
    wide = (ad.COUNTER_MIN + 16, ad.COUNTER_MIN + 16, 32, 16)  # more KV heads than a new counter has
    for pos in [3, 64, 200]:
        _step_fused_vs_two(_step_inputs(rng, wide, pos), pos, f"{wide} pos={pos} seed={seed}")
        assert int(ad.counter(1).shape[0]) >= wide[1], "counter not grown"
        assert not cp.asnumpy(ad.counter(1)).any(), f"{wide} pos={pos} seed={seed}: counter not zeroed"
    args = _step_inputs(rng, SHAPES[0], 300)  # a small shape again, after the growth
    _step_fused_vs_two(args, 300, f"{SHAPES[0]} after growth seed={seed}")


@pytest.mark.parametrize("rows", [1, 64, 65, 1000])
def test_attention_decode_fused_equals_two_launches(rows: int) -> None:
    """The plain op with a strided gate: fused == two launches bitwise, for y and every split."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d = 16, 4, 256
    q, keys, values = (cp.asarray(rng.standard_normal(s).astype(np.float32))
                       for s in [(h, d), (rows, hkv, d), (rows, hkv, d)])
    gate = cp.asarray(rng.standard_normal((h, 2 * d)).astype(np.float32))[:, d:]
    y1, y2 = (cp.full((h, d), np.nan, dtype=cp.float32) for _ in range(2))
    ad.attention_decode(q, keys, values, gate=gate, out=y1)
    ad.attention_decode(q, keys, values, gate=gate, out=y2, fused=False)
    assert np.isfinite(cp.asnumpy(y1)).all(), f"rows={rows} seed={seed}: fused y not fully written"
    assert np.array_equal(_bits(y1), _bits(y2)), f"rows={rows} seed={seed}: fused y != two-launch y"
    for split in SPLITS:
        x1, x2 = (cp.full((1, gemv.PARTS[split], h * d), POISON, dtype=cp.uint16) for _ in range(2))
        ad.attention_decode(q, keys, values, gate=gate, split=split, xs=x1)
        ad.attention_decode(q, keys, values, gate=gate, split=split, xs=x2, fused=False)
        assert np.array_equal(_bits(x1), _bits(x2)), f"rows={rows} {split} seed={seed}: fused xs != two-launch xs"


@pytest.mark.parametrize("split", SPLITS)
def test_attention_decode_split(split: str) -> None:
    """The plain op with a gate: split output == gemv.prepare of its fp32 output [H, D] as one row."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rows = 16, 4, 256, 300
    q, keys, values = (cp.asarray(rng.standard_normal(s).astype(np.float32))
                       for s in [(h, d), (rows, hkv, d), (rows, hkv, d)])
    qg = cp.asarray(rng.standard_normal((h, 2 * d)).astype(np.float32))
    y = cp.full((h, d), np.nan, dtype=cp.float32)
    ad.attention_decode(q, keys, values, gate=qg[:, d:], out=y)
    ref = ad.reference(cp.asnumpy(q), cp.asnumpy(keys), cp.asnumpy(values))
    ref = ref * (1.0 / (1.0 + np.exp(-cp.asnumpy(qg[:, d:]).astype(np.float64))))
    assert max_rel_error(cp.asnumpy(y), ref) <= TOL, f"seed={seed}: gated output vs reference"
    xs = cp.full((1, gemv.PARTS[split], h * d), POISON, dtype=cp.uint16)
    ad.attention_decode(q, keys, values, gate=qg[:, d:], split=split, xs=xs)
    want = cp.asnumpy(gemv.prepare(y.reshape(1, -1), split))
    assert np.array_equal(cp.asnumpy(xs), want), f"{split} seed={seed}: xs != prepare(y)"


def test_attention_decode_rejects_bad_arguments() -> None:
    z = cp.zeros
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ad.attention_decode(z((6, 64), cp.float32), z((4, 4, 64), cp.float32), z((4, 4, 64), cp.float32))
    with pytest.raises(ValueError, match="values"):
        ad.attention_decode(z((8, 64), cp.float32), z((4, 4, 64), cp.float32), z((5, 4, 64), cp.float32))
    with pytest.raises(ValueError, match="pos"):
        ad.attention_decode_step(z((8, 128), cp.float32), z((2, 64), cp.float32), z((2, 64), cp.float32),
                                 z(64, cp.float32), z(64, cp.float32), z(8, cp.float32), z((16, 2, 64), cp.float32),
                                 z((16, 2, 64), cp.float32), 16, 1e-6)
    step = (z((8, 128), cp.float32), z((2, 64), cp.float32), z((2, 64), cp.float32), z(64, cp.float32),
            z(64, cp.float32), z(8, cp.float32), z((16, 2, 64), cp.float32), z((16, 2, 64), cp.float32), 3, 1e-6)
    with pytest.raises(ValueError, match="split"):
        ad.attention_decode_step(*step, split="fp8")
    with pytest.raises(ValueError, match="xs"):
        ad.attention_decode_step(*step, split="bf16", xs=z((1, 2, 512), cp.uint16))  # bf16 has 3 parts
    with pytest.raises(ValueError, match="xs"):
        ad.attention_decode_step(*step, split="f16", xs=z((1, 2, 512), cp.float32))
    with pytest.raises(ValueError, match="xs"):
        ad.attention_decode_step(*step, xs=z((1, 2, 512), cp.uint16))  # xs without split
    with pytest.raises(ValueError, match="out"):
        ad.attention_decode_step(*step, out=z(512, cp.float32), split="f16")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("pos", [0, 64, 130, 700])
@pytest.mark.parametrize("shape", SHAPES)
def test_head_splits_keep_the_bits(shape: tuple[int, int, int, int], pos: int, fused: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """attn_partial with a KV head's query heads over Z blocks (every divisor Z of G, forced through head_splits)
    gives the bits of Z = 1: y, the split operand and both caches (row `pos` written once, by block z = 0)."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, _ = shape
    group = h // hkv
    *inputs, kc, vc = _step_inputs(rng, shape, pos)
    outs = {}
    for z in [z for z in range(1, group + 1) if group % z == 0]:
        monkeypatch.setattr(ad, "head_splits", lambda _g, _b, z=z: z)
        k2, v2 = kc.copy(), vc.copy()
        y = cp.full((h * d,), np.nan, dtype=cp.float32)
        ad.attention_decode_step(*inputs, k2, v2, pos, 1e-6, out=y, fused=fused)
        xs = cp.full((1, 2, h * d), POISON, dtype=cp.uint16)
        ad.attention_decode_step(*inputs, k2.copy(), v2.copy(), pos, 1e-6, split="f16p", xs=xs, fused=fused)
        outs[z] = (_bits(y), cp.asnumpy(xs), _bits(k2), _bits(v2))
        assert np.isfinite(cp.asnumpy(y)).all(), f"{shape} pos={pos} Z={z} seed={seed}: y not fully written"
        for name, a, b in zip(("y", "xs", "keys", "values"), outs[z], outs[1]):
            assert np.array_equal(a, b), f"{shape} pos={pos} fused={fused} Z={z} seed={seed}: {name} != Z = 1"
    assert not cp.asnumpy(ad.counter(1)).any(), f"{shape} pos={pos}: counter not left zeroed"


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("split", [None, "f16", "bf16"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_step_equals_the_launcher(shape: tuple[int, int, int, int], fused: bool, split: str | None,
                                         pdl: bool) -> None:
    """DecodeStep (prebuilt argument blocks, plan.Relaunch; a launch plan's attention call) gives
    attention_decode_step's bits at every position of a run crossing chunk boundaries and head-split changes
    (0 ... 70, 127-129, 4095 of a 4096-row cache): the output (NaN / 0xFFFF-poisoned, in place, rewritten each
    call) and both caches; one scratch shared by two layers' steps; positions outside the cache raise."""
    from tandem.backend.cuda import plan

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, _ = shape
    args = _step_inputs(rng, shape, 4096)  # cache rows [0, 4096) random
    *inputs, kc, vc = args
    kc2, vc2 = kc.copy(), vc.copy()
    scratch = ad.decode_scratch(kc, h)
    if split is None:
        y_step = cp.full((h * d,), np.nan, dtype=cp.float32)
        step = ad.DecodeStep(*inputs, kc, vc, 1e-6, out=y_step, fused=fused, scratch=scratch)
        assert step.result is y_step or step.result.data.ptr == y_step.data.ptr
    else:
        step = ad.DecodeStep(*inputs, kc, vc, 1e-6, split=split, fused=fused, scratch=scratch)
    other = ad.DecodeStep(*inputs, kc2.copy(), vc2.copy(), 1e-6, split="f16", fused=fused, scratch=scratch)
    saved = plan.use_pdl
    try:
        plan.use_pdl = pdl
        for pos in [*range(0, 71), 127, 128, 129, 4095]:
            step.result[...] = np.nan if split is None else POISON
            step(pos)
            other(pos)  # the shared scratch rewritten between the two layers' calls, as in a plan
            want = ad.attention_decode_step(*inputs, kc2, vc2, pos, 1e-6, split=split, fused=fused)
            tag = f"{shape} fused={fused} split={split} pdl={pdl} pos={pos} seed={seed}"
            assert np.array_equal(_bits(step.result), _bits(want).reshape(_bits(step.result).shape)), tag
            assert np.array_equal(_bits(kc[pos]), _bits(kc2[pos])) and np.array_equal(_bits(vc[pos]),
                                                                                       _bits(vc2[pos])), tag
    finally:
        plan.use_pdl = saved
    assert not cp.asnumpy(ad.counter(1)).any(), "counter not left zeroed"
    for bad in (-1, 4096):
        with pytest.raises(ValueError, match="outside the cache"):
            step(bad)
    with pytest.raises(ValueError, match="xs"):
        ad.DecodeStep(*inputs, kc, vc, 1e-6, xs=cp.zeros((1, 2, h * d), dtype=cp.uint16))
    with pytest.raises(ValueError, match="out"):
        ad.DecodeStep(*inputs, kc, vc, 1e-6, out=cp.zeros((h * d,), dtype=cp.float32), split="f16")
    small = tuple(a[:10] for a in scratch)  # 10 chunks for a 4096-row cache
    with pytest.raises(ValueError, match="chunks"):
        ad.DecodeStep(*inputs, kc, vc, 1e-6, split="f16", scratch=small)
