"""CUDA attention with the KV cache in bf16 and fp32 (cuda/attention_common.cuh kv_store / kv_load), and the long-
context launch shapes: DecodeStep's unfused combine past attention_decode.FUSED_MAX_CHUNKS and its split decode (from
SPLIT_DECODE_MIN_CHUNKS), tree verify's chunks below P by prefill_partial (attention_tree.shared_chunks).

Checks, for both storages: decode within relative 1e-5 (bf16: 2e-4) of reference_step on the same storage, its V
row stored bit for bit as dtypes.f32_to_bf16(v_new); DecodeStep == attention_decode_step bitwise across the split
switch; tree rows bitwise equal to decode rows over their paths at committed lengths with and without shared
chunks; prefill rows bitwise equal to decode rows; commit copies bf16 rows exactly; TreeStep == attention_tree_step
on bf16 caches.
Caches past the written rows are NaN-poisoned (0xFFFF bits for bf16), so a read past them shows.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import attention_tree as at  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

SHAPES = [(6, 2, 64, 16), (24, 4, 256, 64)]  # (H, Hkv, D, rotary dims): the default model's, Qwen3.5-27B's
THETA, EPS = 1e7, 1e-6
KV = ["fp32", "bf16"]


def _cache(rng: np.random.Generator, rows: int, filled: int, hkv: int, d: int, kv: str) -> np.ndarray:
    """A host cache of `rows` rows, the first `filled` random, the rest NaN (fp32) / 0xFFFF (bf16 NaN bits)."""
    x = rng.standard_normal((filled, hkv, d)).astype(np.float32)
    if kv == "fp32":
        c = np.full((rows, hkv, d), np.nan, dtype=np.float32)
        c[:filled] = x
    else:
        c = np.full((rows, hkv, d), 0xFFFF, dtype=np.uint16)
        c[:filled] = f32_to_bf16(x)
    return c


def _bits(a: Any) -> np.ndarray:
    host = cp.asnumpy(a)
    return host.view(np.uint32) if host.dtype == np.float32 else host


def _step_args(rng: np.random.Generator, shape: tuple[int, int, int, int], n: int) -> dict[str, np.ndarray]:
    h, hkv, d, _ = shape
    return {"qg": rng.standard_normal((n, h, 2 * d)).astype(np.float32),
            "k_new": rng.standard_normal((n, hkv, d)).astype(np.float32),
            "v_new": rng.standard_normal((n, hkv, d)).astype(np.float32),
            "q_norm": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
            "k_norm": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)}


@pytest.mark.parametrize("pos", [0, 63, 700, 4100, 5000, 32767])
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_step_against_the_reference(shape: tuple[int, int, int, int], kv: str, pos: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    x = _step_args(rng, shape, 1)
    rows = max(5120, pos + 1)  # the 32k case: a long context against the NumPy reference
    kc, vc = _cache(rng, rows, pos, hkv, d, kv), _cache(rng, rows, pos, hkv, d, kv)
    dk, dv = cp.asarray(kc), cp.asarray(vc)
    y = cp.full((h * d,), np.nan, dtype=cp.float32)
    ad.attention_decode_step(cp.asarray(x["qg"][0]), cp.asarray(x["k_new"][0]), cp.asarray(x["v_new"][0]),
                             cp.asarray(x["q_norm"]), cp.asarray(x["k_norm"]), cp.asarray(ad.inv_freq(rd, THETA)),
                             dk, dv, pos, EPS, out=y)
    want = ad.reference_step(x["qg"][0], x["k_new"][0], x["v_new"][0], x["q_norm"], x["k_norm"], rd, THETA, kc, vc,
                             pos, EPS)
    got = cp.asnumpy(y)
    err, merr = rel_error(got, want), max_rel_error(got, want)
    tag = f"{shape} kv={kv} pos={pos} seed={seed}"
    # bf16: the new k row's fp32 value (device RoPE vs NumPy's) may round to the neighbouring bf16 value in a rare
    # channel, a 2^-8 relative change of one key entry, hence the looser bound
    tol = 1e-5 if kv == "fp32" else 2e-4
    assert err <= tol and merr <= tol, f"{tag}: rel {err:.3g} max {merr:.3g}"
    v_row = cp.asnumpy(dv[pos])
    assert np.array_equal(v_row, x["v_new"][0] if kv == "fp32" else f32_to_bf16(x["v_new"][0])), f"{tag}: v row"
    k_dev, k_ref = cp.asnumpy(dk[pos]), kc[pos]
    if kv == "bf16":  # the k row's fp32 value may differ in its last bits from NumPy's, so its rounding by one ulp
        k_dev, k_ref = bf16_to_f32(k_dev), bf16_to_f32(k_ref)
    assert max_rel_error(k_dev, k_ref) <= (2.0 ** -7 if kv == "bf16" else 1e-6), f"{tag}: k row"
    assert np.array_equal(_bits(dk[pos + 1:]), _bits(cp.asarray(kc[pos + 1:]))), f"{tag}: rows past pos written"
    record(f"attention_decode_kv{list(shape)}[{kv},pos={pos}]", rel=err, max_rel=merr, seed=seed)


@pytest.mark.parametrize("split", [None, 65])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kv", KV)
def test_decode_step_bits_across_the_switches(kv: str, fused: bool, split: int | None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """DecodeStep (attn_partial, its combine fused up to FUSED_MAX_CHUNKS chunks and attn_combine past them; with
    SPLIT_DECODE_MIN_CHUNKS set, the split decode from there: attn_prep_rows, prefill_partial, attn_combine) gives
    attention_decode_step's bits (attn_partial, fused or not), output and caches, at positions on both sides of the
    switches, one step reused across them."""
    monkeypatch.setattr(ad, "SPLIT_DECODE_MIN_CHUNKS", split)
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = SHAPES[1]
    x = {k: cp.asarray(v) for k, v in _step_args(rng, SHAPES[1], 1).items()}
    top = ad.FUSED_MAX_CHUNKS * ad.CHUNK
    kc, vc = (cp.asarray(_cache(rng, top + 1024, top + 1024, hkv, d, kv)) for _ in range(2))
    kd, vd = kc.copy(), vc.copy()
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    args = (x["qg"][0], x["k_new"][0], x["v_new"][0], x["q_norm"], x["k_norm"], freq)
    step = ad.DecodeStep(*args, kc, vc, EPS, fused=fused)
    y = cp.empty((h * d,), dtype=cp.float32)
    for pos in (top - 65, top - 1, top, top + 63, top + 700, 100, top + 1):
        step.result[...] = np.nan
        step(pos)
        ad.attention_decode_step(*args, kd, vd, pos, EPS, out=y, fused=fused)
        tag = f"kv={kv} fused={fused} split from {split} pos={pos} seed={seed}"
        assert np.array_equal(_bits(step.result), _bits(y)), f"{tag}: DecodeStep != attention_decode_step"
        assert np.array_equal(_bits(kc), _bits(kd)) and np.array_equal(_bits(vc), _bits(vd)), f"{tag}: caches"


def _node_arrays(n: int, hkv: int, d: int, kv: str) -> tuple[Any, Any]:
    dtype = cp.float32 if kv == "fp32" else cp.uint16
    return cp.empty((n, hkv, d), dtype=dtype), cp.empty((n, hkv, d), dtype=dtype)


@pytest.mark.parametrize("start", [240, 1000, 1024, 1500, 4100, 32752])
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_rows_equal_decode_rows(shape: tuple[int, int, int, int], kv: str, start: int) -> None:
    """Row invariance for either storage: each node's output and k row have the bits of attention_decode_step at its
    position over its path, with tree_partial alone (P < 16 · 64) and with prefill_partial taking the chunks below
    P (P ≥ 1024)."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 16)]
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    n, (h, hkv, d, rd) = len(parents), shape
    x = {k: cp.asarray(v) for k, v in _step_args(rng, shape, n).items()}
    kc0, vc0 = (cp.asarray(_cache(rng, start + 64, start, hkv, d, kv)) for _ in range(2))
    node_k, node_v = _node_arrays(n, hkv, d, kv)
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    y = cp.asnumpy(at.attention_tree_step(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], freq, kc0, vc0,
                                          start, depths, parents, EPS, node_k, node_v))
    shared = at.shared_chunks(start, n, d)
    for i in range(n):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        kc, vc = kc0.copy(), vc0.copy()
        at.attention_commit(kc, vc, node_k, node_v, start, path[::-1][:-1])
        pos = start + len(path) - 1
        row = ad.attention_decode_step(x["qg"][i], x["k_new"][i], x["v_new"][i], x["q_norm"], x["k_norm"], freq, kc,
                                       vc, pos, EPS)
        tag = f"{shape} kv={kv} P={start} (shared chunks {shared}) node {i} pos {pos} seed={seed}"
        assert np.array_equal(cp.asnumpy(row).view(np.uint32), y[i].view(np.uint32)), tag
        assert np.array_equal(_bits(kc[pos]), _bits(node_k[i])), f"{tag}: k row differs from decode's"
        assert np.array_equal(_bits(vc[pos]), _bits(node_v[i])), f"{tag}: v row differs from decode's"


@pytest.mark.parametrize(("start", "tokens"), [(0, 100), (63, 3), (1000, 70), (32704, 64)])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_prefill_rows_equal_decode_rows(shape: tuple[int, int, int, int], start: int, tokens: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    x = {k: cp.asarray(v) for k, v in _step_args(rng, shape, tokens).items()}
    hk, hv = (_cache(rng, start + tokens + 8, start, hkv, d, "bf16") for _ in range(2))
    kc, vc = cp.asarray(hk), cp.asarray(hv)
    kd, vd = kc.copy(), vc.copy()
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    y = cp.asnumpy(at.attention_prefill_step(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], freq, kc, vc,
                                             start, EPS))
    rows = cp.empty((tokens, h * d), dtype=cp.float32)
    for t in range(tokens):
        ad.attention_decode_step(x["qg"][t], x["k_new"][t], x["v_new"][t], x["q_norm"], x["k_norm"], freq, kd, vd,
                                 start + t, EPS, out=rows[t])
    bad = np.flatnonzero(~np.all(y.view(np.uint32) == cp.asnumpy(rows).view(np.uint32), axis=1))
    assert bad.size == 0, f"{shape} P={start} T={tokens} seed={seed}: rows {bad[:8].tolist()} differ from decode's"
    assert np.array_equal(_bits(kc), _bits(kd)) and np.array_equal(_bits(vc), _bits(vd)), "caches differ"
    ref = at.reference_prefill(*(cp.asnumpy(x[k]) for k in ("qg", "k_new", "v_new", "q_norm", "k_norm")), rd, THETA,
                               hk, hv, start, EPS)
    assert rel_error(y, ref) <= 5e-4, f"{shape} P={start} T={tokens} seed={seed}: rel {rel_error(y, ref):.3g}"
    assert np.array_equal(hv[start:start + tokens], cp.asnumpy(vc[start:start + tokens])), "v rows"


def test_bf16_commit_and_tree_step() -> None:
    """attn_commit_rows_bf16 copies node rows bit for bit; TreeStep on bf16 caches (shared chunks past P = 1024)
    equals attention_tree_step, output and node rows."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = SHAPES[1]
    parents = [-1, 0, 1, 2, 1, 0, 5, 3]
    n = len(parents)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    max_len = 3000
    x = {k: cp.asarray(v) for k, v in _step_args(rng, SHAPES[1], n).items()}
    kc, vc = (cp.asarray(_cache(rng, max_len, max_len, hkv, d, "bf16")) for _ in range(2))
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    dep, par = cp.asarray(depths, dtype=cp.int32), cp.asarray(parents, dtype=cp.int32)
    nodes = [_node_arrays(n, hkv, d, "bf16") for _ in range(2)]
    args = (x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], freq, kc, vc, dep, par, EPS)
    step = at.TreeStep(*args, *nodes[0])
    for start in (0, 100, 1000, 1024, 2000, max_len - 40):
        step.result[...] = np.nan
        step(start)
        want = at.attention_tree_step(*args[:8], start, *args[8:], *nodes[1])
        tag = f"start={start} seed={seed}"
        assert np.array_equal(_bits(step.result), _bits(want)), tag
        assert np.array_equal(_bits(nodes[0][0]), _bits(nodes[1][0])), tag
        assert np.array_equal(_bits(nodes[0][1]), _bits(nodes[1][1])), tag
    kd, vd = kc.copy(), vc.copy()
    at.attention_commit(kd, vd, nodes[0][0], nodes[0][1], 10, [0, 1, 2, 3])
    assert np.array_equal(_bits(kd[10:14]), _bits(nodes[0][0][[0, 1, 2, 3]]))
    assert np.array_equal(_bits(vd[10:14]), _bits(nodes[0][1][[0, 1, 2, 3]]))
    assert np.array_equal(_bits(kd[14:]), _bits(kc[14:])) and np.array_equal(_bits(kd[:10]), _bits(kc[:10]))
