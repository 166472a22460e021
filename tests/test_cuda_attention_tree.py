"""CUDA tree-verify and prefill attention (cuda/attention_tree.cu) vs the NumPy references on fresh random inputs.

Checks: tree rows within relative 1e-5 of reference_tree (chain, bush, random 32 nodes; starts on both sides of
a 64-row chunk boundary) on NaN-poisoned outputs with NaN cache rows ≥ P (never read); node rows bitwise equal to
attention_decode_step over the node's path (row invariance); commit copies rows exactly; prefill (the exact kernel
and the flash baseline) within 1e-4 of reference_prefill, a row's bits independent of how the rows are cut into
calls; exact prefill rows bitwise equal to attention_decode_step at their positions;
ValueError on bad arguments; the split outputs of tree verify and prefill (split="f16" /
"f16p" / "bf16": the o projection's GEMV operand) equal bit for bit to gemv.prepare of the fp32 output, on
NaN-poisoned (0xFFFF) operands.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import attention_tree as at  # noqa: E402
from tandem.backend.cuda import gemv  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (H, Hkv, D, rotary dims): the embedded default model's attention and Qwen3.5-27B's
SHAPES = [(6, 2, 64, 16), (24, 4, 256, 64)]
THETA, EPS, MAX_LEN = 1e7, 1e-6, 4608
SPLITS = ["f16", "f16p", "bf16"]
POISON = 0xFFFF  # fp16 / bf16 NaN bits: a finite value never splits to them


def _tree(kind: str, rng: np.random.Generator) -> list[int]:
    if kind == "chain":
        return [-1] + list(range(11))
    if kind == "bush":  # root, 7 children, 2 grandchildren under each of the first 4
        return [-1] + [0] * 7 + [1 + i // 2 for i in range(8)]
    return [-1] + [int(rng.integers(0, i)) for i in range(1, 32)]


def _depths(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def _inputs(rng: np.random.Generator, shape: tuple[int, int, int, int], rows: int, start: int) -> dict[str, np.ndarray]:
    h, hkv, d, _ = shape

    def f32(*s: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(s) * scale).astype(np.float32)

    k_cache = np.full((MAX_LEN, hkv, d), np.nan, dtype=np.float32)
    v_cache = k_cache.copy()
    k_cache[:start], v_cache[:start] = f32(start, hkv, d), f32(start, hkv, d)
    return {"qg": f32(rows, h, 2 * d), "k_new": f32(rows, hkv, d), "v_new": f32(rows, hkv, d),
            "q_norm": (1.0 + f32(d, scale=0.1)).astype(np.float32),
            "k_norm": (1.0 + f32(d, scale=0.1)).astype(np.float32), "k_cache": k_cache, "v_cache": v_cache}


@pytest.mark.parametrize("start", [0, 1, 60, 250, 700, 4000])
@pytest.mark.parametrize("kind", ["chain", "bush", "random"])
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_tree(shape: tuple[int, int, int, int], kind: str, start: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    parents = _tree(kind, rng)
    n, (h, hkv, d, rd) = len(parents), shape
    x = _inputs(rng, shape, n, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    node_k = cp.full((n, hkv, d), np.nan, dtype=cp.float32)
    node_v = cp.full((n, hkv, d), np.nan, dtype=cp.float32)
    y = cp.full((n, h * d), np.nan, dtype=cp.float32)
    depths = _depths(parents) if kind != "random" else cp.asarray(_depths(parents), dtype=cp.int32)
    par = parents if kind != "random" else cp.asarray(parents, dtype=cp.int32)
    at.attention_tree_step(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"],
                           cp.asarray(ad.inv_freq(rd, THETA)), dev["k_cache"], dev["v_cache"], start, depths, par,
                           EPS, node_k, node_v, out=y)
    ref, ref_k = at.reference_tree(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], rd, THETA,
                                   x["k_cache"], x["v_cache"], start, parents, EPS)
    got = cp.asnumpy(y)
    err, merr = rel_error(got, ref), max_rel_error(got, ref)
    k_err = max_rel_error(cp.asnumpy(node_k), ref_k)
    assert err <= 1e-5 and merr <= 1e-5, f"{shape} {kind} P={start} seed={seed}: rel {err:.3g} max {merr:.3g}"
    assert k_err <= 1e-6, f"node k rows {k_err:.3g}"
    assert np.array_equal(cp.asnumpy(node_v), x["v_new"]), "v rows must be copied exactly"
    assert np.isnan(cp.asnumpy(dev["k_cache"][start:])).all(), "cache rows ≥ P must stay untouched"
    record(f"attention_tree{list(shape)}[{kind},P={start}]", rel=err, max_rel=merr, seed=seed)


@pytest.mark.parametrize("start", [240, 128, 0])
@pytest.mark.parametrize("shape", SHAPES + [(8, 2, 192, 64)])
def test_tree_rows_equal_decode_rows(shape: tuple[int, int, int, int], start: int) -> None:
    """Row invariance: each node's output has the bits of attention_decode_step at its position over its path. At
    P = 240 the paths cross the chunk boundary at 256 (64 · 4) from a chunk of cache rows; at 128 the node rows start
    a chunk; at 0 there is no cache row. Head dim 192: tree_partial's static and dynamic shared memory together pass
    48 KiB while its dynamic part alone does not (loader.raise_smem_limit)."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    parents = _tree("random", rng)
    n, (h, hkv, d, rd) = len(parents), shape
    x = _inputs(rng, shape, n, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    node_k = cp.empty((n, hkv, d), dtype=cp.float32)
    node_v = cp.empty((n, hkv, d), dtype=cp.float32)
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    y = cp.asnumpy(at.attention_tree_step(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], freq,
                                          dev["k_cache"], dev["v_cache"], start, _depths(parents), parents, EPS,
                                          node_k, node_v))
    for i in range(n):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        kc, vc = dev["k_cache"].copy(), dev["v_cache"].copy()
        at.attention_commit(kc, vc, node_k, node_v, start, path[::-1][:-1])
        pos = start + len(path) - 1
        row = ad.attention_decode_step(dev["qg"][i], dev["k_new"][i], dev["v_new"][i], dev["q_norm"],
                                       dev["k_norm"], freq, kc, vc, pos, EPS)
        assert np.array_equal(cp.asnumpy(row), y[i]), f"{shape} node {i} (pos {pos}) seed={seed}"
        assert np.array_equal(cp.asnumpy(kc[pos]), cp.asnumpy(node_k[i])), f"node {i}: k row differs from decode's"


@pytest.mark.parametrize("device_path", [False, True])
def test_attention_commit(device_path: bool) -> None:
    """attention_commit (attn_commit_rows) copies the path's node rows to cache rows start.. exactly, k and v, and
    nothing else (NaN-poisoned caches); a path past the cache or a node outside the tree raises."""
    rng = np.random.default_rng(secrets.randbits(32))
    node_k = cp.asarray(rng.standard_normal((8, 2, 64)).astype(np.float32))
    node_v = cp.asarray(rng.standard_normal((8, 2, 64)).astype(np.float32))
    kc = cp.full((32, 2, 64), np.nan, dtype=cp.float32)
    vc = kc.copy()
    dev = cp.asarray([0, 2, 6], dtype=cp.int32) if device_path else None
    at.attention_commit(kc, vc, node_k, node_v, 5, [0, 2, 6], path_device=dev)
    assert np.array_equal(cp.asnumpy(kc[5:8]), cp.asnumpy(node_k[[0, 2, 6]]))
    assert np.array_equal(cp.asnumpy(vc[5:8]), cp.asnumpy(node_v[[0, 2, 6]]))
    assert np.isnan(cp.asnumpy(kc[8:])).all() and np.isnan(cp.asnumpy(kc[:5])).all()
    assert np.isnan(cp.asnumpy(vc[8:])).all() and np.isnan(cp.asnumpy(vc[:5])).all()
    with pytest.raises(ValueError, match="outside the cache"):
        at.attention_commit(kc, vc, node_k, node_v, 30, [0, 2, 6])
    with pytest.raises(ValueError, match="outside the cache"):
        at.attention_commit(kc, vc, node_k, node_v, 0, [0, 8])


@pytest.mark.parametrize("pdl", [True, False])
def test_commit_step_equals_attention_commit(pdl: bool) -> None:
    """CommitStep (a commit plan's attention call: prebuilt arguments, the path read from a device array the caller
    rewrites) == attention_commit for paths and starts that change between calls; rows outside untouched; a start
    past the cache raises."""
    from tandem.backend.cuda import plan

    rng = np.random.default_rng(secrets.randbits(32))
    node_k = cp.asarray(rng.standard_normal((16, 4, 256)).astype(np.float32))
    node_v = cp.asarray(rng.standard_normal((16, 4, 256)).astype(np.float32))
    kc, kc2 = (cp.full((300, 4, 256), np.nan, dtype=cp.float32) for _ in range(2))
    vc, vc2 = kc.copy(), kc2.copy()
    path_dev = cp.zeros(3, dtype=cp.int32)
    step = at.CommitStep(kc, vc, node_k, node_v, path_dev, 3)
    saved = plan.use_pdl
    try:
        plan.use_pdl = pdl
        for start, path in [(0, [0, 1, 3]), (5, [0, 2, 9]), (62, [0, 5, 15]), (297, [0, 1, 2])]:
            path_dev.set(np.asarray(path, dtype=np.int32))
            step(start)
            at.attention_commit(kc2, vc2, node_k, node_v, start, path)
            assert np.array_equal(cp.asnumpy(kc).view(np.uint32), cp.asnumpy(kc2).view(np.uint32)), (start, path)
            assert np.array_equal(cp.asnumpy(vc).view(np.uint32), cp.asnumpy(vc2).view(np.uint32)), (start, path)
    finally:
        plan.use_pdl = saved
    assert np.isnan(cp.asnumpy(kc[3:5])).all() and np.isnan(cp.asnumpy(vc[8:62])).all()
    with pytest.raises(ValueError, match="outside the cache"):
        step(298)


@pytest.mark.parametrize(("start", "tokens"), [(0, 1), (0, 100), (37, 64), (300, 129), (1000, 1000), (500, 4096)])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_prefill(shape: tuple[int, int, int, int], exact: bool, start: int, tokens: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    x = _inputs(rng, shape, tokens, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    y = cp.full((tokens, h * d), np.nan, dtype=cp.float32)
    at.attention_prefill_step(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"],
                              cp.asarray(ad.inv_freq(rd, THETA)), dev["k_cache"], dev["v_cache"], start, EPS, out=y,
                              exact=exact)
    ref = at.reference_prefill(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], rd, THETA, x["k_cache"],
                               x["v_cache"], start, EPS)
    got = cp.asnumpy(y)
    err, merr = rel_error(got, ref), max_rel_error(got, ref)
    k_err = max_rel_error(cp.asnumpy(dev["k_cache"][start:start + tokens]), x["k_cache"][start:start + tokens])
    assert err <= 1e-4 and merr <= 1e-4, f"{shape} P={start} T={tokens} seed={seed}: rel {err:.3g} max {merr:.3g}"
    assert k_err <= 1e-6, f"cache k rows {k_err:.3g}"
    assert np.array_equal(cp.asnumpy(dev["v_cache"][start:start + tokens]), x["v_new"])
    assert np.isnan(cp.asnumpy(dev["k_cache"][start + tokens:])).all(), "rows past the prefill stay untouched"
    record(f"attention_prefill{list(shape)}[P={start},T={tokens},exact={exact}]", rel=err, max_rel=merr, seed=seed)


@pytest.mark.parametrize("device_tree", [False, True])
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_tree_split(shape: tuple[int, int, int, int], split: str, device_tree: bool) -> None:
    """split=kind writes xs [N, P, H·D] == gemv.prepare(y, kind) bitwise, y from the unsplit call."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    parents, start = _tree("random", rng), 250  # paths cross the chunk boundary at 256
    n, (h, hkv, d, rd) = len(parents), shape
    x = _inputs(rng, shape, n, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    depths = cp.asarray(_depths(parents), dtype=cp.int32) if device_tree else _depths(parents)
    par = cp.asarray(parents, dtype=cp.int32) if device_tree else parents
    args = (dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], cp.asarray(ad.inv_freq(rd, THETA)),
            dev["k_cache"], dev["v_cache"], start, depths, par, EPS)
    node_k = cp.full((n, hkv, d), np.nan, dtype=cp.float32)
    node_v = cp.full((n, hkv, d), np.nan, dtype=cp.float32)
    y = cp.full((n, h * d), np.nan, dtype=cp.float32)
    at.attention_tree_step(*args, node_k, node_v, out=y)
    ref, _ = at.reference_tree(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], rd, THETA, x["k_cache"],
                               x["v_cache"], start, parents, EPS)
    err = max_rel_error(cp.asnumpy(y), ref)
    assert err <= 1e-5, f"{shape} P={start} seed={seed}: unsplit output max rel {err:.3g}"
    want = cp.asnumpy(gemv.prepare(y, split))
    xs = cp.full((n, gemv.PARTS[split], h * d), POISON, dtype=cp.uint16)
    node_k2 = cp.full((n, hkv, d), np.nan, dtype=cp.float32)
    node_v2 = cp.full((n, hkv, d), np.nan, dtype=cp.float32)
    assert at.attention_tree_step(*args, node_k2, node_v2, split=split, xs=xs) is xs
    assert np.array_equal(cp.asnumpy(xs), want), f"{shape} {split} P={start} seed={seed}: xs != prepare(y)"
    assert np.array_equal(cp.asnumpy(node_k2), cp.asnumpy(node_k)), "node k rows must not depend on split"
    assert np.array_equal(cp.asnumpy(node_v2), x["v_new"]), "v rows must be copied exactly"
    fresh = at.attention_tree_step(*args, node_k2, node_v2, split=split)  # allocated by the launcher
    assert fresh.dtype == cp.uint16 and fresh.shape == (n, gemv.PARTS[split], h * d)
    assert np.array_equal(cp.asnumpy(fresh), want), f"{shape} {split} seed={seed}: allocated xs"


@pytest.mark.parametrize(("start", "tokens"), [(0, 1), (0, 100), (37, 64), (63, 3), (300, 129), (1000, 70)])
@pytest.mark.parametrize("shape", SHAPES + [(8, 2, 192, 64), (16, 2, 128, 64)])
def test_prefill_rows_equal_decode_rows(shape: tuple[int, int, int, int], start: int, tokens: int) -> None:
    """Every prefill row has the bits of attention_decode_step at its position over the rows the prefill wrote
    (prefill_partial: decode's chunks and arithmetic), and decode rewrites the prefill's cache row with the same bits.
    Shapes: G = 3, 6, 4 at head dim 192, 8 at head dim 128 (blocks of 66, 66, 64, 64 rows for 64 tokens); starts and
    lengths on both sides of 64-row chunk boundaries, and past one launch's 64 tokens."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    x = _inputs(rng, shape, tokens, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    y = cp.full((tokens, h * d), np.nan, dtype=cp.float32)
    at.attention_prefill_step(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], freq,
                              dev["k_cache"], dev["v_cache"], start, EPS, out=y)
    got = cp.asnumpy(y)
    kc, vc = dev["k_cache"].copy(), dev["v_cache"].copy()
    rows = cp.empty((tokens, h * d), dtype=cp.float32)
    for t in range(tokens):
        ad.attention_decode_step(dev["qg"][t], dev["k_new"][t], dev["v_new"][t], dev["q_norm"], dev["k_norm"], freq,
                                 kc, vc, start + t, EPS, out=rows[t])
    want = cp.asnumpy(rows)
    bad = np.flatnonzero(~np.all(got.view(np.uint32) == want.view(np.uint32), axis=1))
    assert bad.size == 0, f"{shape} P={start} T={tokens} seed={seed}: rows {bad[:8].tolist()} differ from decode's"
    assert np.array_equal(cp.asnumpy(kc).view(np.uint32), cp.asnumpy(dev["k_cache"]).view(np.uint32))


@pytest.mark.parametrize("split", [None, "bf16"])
def test_prefill_by_decode_equals_prefill_partial(split: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device whose shared memory a block cannot hold prefill_partial's, the exact prefill decodes token by
    token: the same output (y, or the split operand xs) and cache rows, bit for bit."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    shape, start, tokens = SHAPES[1], 37, 70
    h, hkv, d, rd = shape
    x = _inputs(rng, shape, tokens, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))

    def run() -> tuple[np.ndarray, np.ndarray]:
        kc, vc = dev["k_cache"].copy(), dev["v_cache"].copy()
        y = at.attention_prefill_step(dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], freq, kc,
                                      vc, start, EPS, split=split)
        return cp.asnumpy(y), cp.asnumpy(kc)

    want, want_k = run()
    monkeypatch.setattr(at, "_smem_optin", lambda: 0)
    got, got_k = run()
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"split {split} seed={seed}"
    assert np.array_equal(got_k.view(np.uint32), want_k.view(np.uint32))


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_prefill_row_depends_on_position_only(shape: tuple[int, int, int, int], exact: bool) -> None:
    """A prefill row has the same bits whether its piece is one call of 300 rows or calls of 64-row pieces that end
    at absolute multiples of 64 (the engine's pieces, after a cache restore): both kernels' key chunks are absolute
    positions."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    start, tokens = 700, 300
    x = _inputs(rng, shape, tokens, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))

    def run(pieces: list[tuple[int, int]]) -> np.ndarray:
        kc, vc = dev["k_cache"].copy(), dev["v_cache"].copy()
        out = [at.attention_prefill_step(dev["qg"][a:b], dev["k_new"][a:b], dev["v_new"][a:b], dev["q_norm"],
                                         dev["k_norm"], freq, kc, vc, start + a, EPS, exact=exact) for a, b in pieces]
        return np.concatenate([cp.asnumpy(o) for o in out])

    whole = run([(0, tokens)])
    cuts = [0, 4] + list(range(68, tokens, 64)) + [tokens]  # 700 + 4 = 704 = 11 · 64
    assert np.array_equal(run(list(zip(cuts[:-1], cuts[1:]))), whole), f"{shape} seed={seed}: pieces differ"


@pytest.mark.parametrize(("start", "tokens"), [(0, 1), (0, 100), (300, 129)])
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_prefill_split(shape: tuple[int, int, int, int], split: str, start: int, tokens: int) -> None:
    """split=kind writes xs [T, P, H·D] == gemv.prepare(y, kind) bitwise, y from the unsplit call."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    x = _inputs(rng, shape, tokens, start)
    dev = {k: cp.asarray(v) for k, v in x.items()}
    args = (dev["qg"], dev["k_new"], dev["v_new"], dev["q_norm"], dev["k_norm"], cp.asarray(ad.inv_freq(rd, THETA)),
            dev["k_cache"], dev["v_cache"], start, EPS)
    y = cp.full((tokens, h * d), np.nan, dtype=cp.float32)
    at.attention_prefill_step(*args, out=y)
    ref = at.reference_prefill(x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], rd, THETA, x["k_cache"],
                               x["v_cache"], start, EPS)
    err = max_rel_error(cp.asnumpy(y), ref)
    assert err <= 1e-4, f"{shape} P={start} T={tokens} seed={seed}: unsplit output max rel {err:.3g}"
    want = cp.asnumpy(gemv.prepare(y, split))
    kc = cp.asnumpy(dev["k_cache"])
    xs = cp.full((tokens, gemv.PARTS[split], h * d), POISON, dtype=cp.uint16)
    assert at.attention_prefill_step(*args, split=split, xs=xs) is xs  # rewrites the same cache rows
    assert np.array_equal(cp.asnumpy(xs), want), f"{shape} {split} P={start} T={tokens} seed={seed}: xs != prepare(y)"
    assert np.array_equal(cp.asnumpy(dev["k_cache"]), kc, equal_nan=True), "cache rows must not depend on split"
    fresh = at.attention_prefill_step(*args, split=split)  # allocated by the launcher
    assert fresh.dtype == cp.uint16 and fresh.shape == (tokens, gemv.PARTS[split], h * d)
    assert np.array_equal(cp.asnumpy(fresh), want), f"{shape} {split} seed={seed}: allocated xs"


def test_attention_tree_rejects_bad_arguments() -> None:
    z = cp.zeros
    args = (z((3, 8, 128), cp.float32), z((3, 2, 64), cp.float32), z((3, 2, 64), cp.float32), z(64, cp.float32),
            z(64, cp.float32), z(8, cp.float32), z((16, 2, 64), cp.float32), z((16, 2, 64), cp.float32))
    nodes = (z((3, 2, 64), cp.float32), z((3, 2, 64), cp.float32))
    with pytest.raises(ValueError, match="tree"):
        at.attention_tree_step(*args, 4, [0, 1, 2], [-1, 0, 0], 1e-6, *nodes)
    with pytest.raises(ValueError, match="past the cache"):  # depth 1 at start 15: position 16 of 16 rows
        at.attention_tree_step(*args, 15, [0, 1, 1], [-1, 0, 0], 1e-6, *nodes)
    at.attention_tree_step(*args, 14, [0, 1, 1], [-1, 0, 0], 1e-6, *nodes)  # 3 nodes but depth 1: fits
    with pytest.raises(ValueError, match="outside the cache"):
        at.attention_prefill_step(*args, 14, 1e-6)
    with pytest.raises(ValueError, match="k_new"):
        at.attention_prefill_step(args[0], z((2, 2, 64), cp.float32), *args[2:], 0, 1e-6)
    with pytest.raises(ValueError, match="split"):
        at.attention_tree_step(*args, 4, [0, 1, 1], [-1, 0, 0], 1e-6, *nodes, split="nvfp4")
    with pytest.raises(ValueError, match="xs"):  # N = 3 rows, not 2
        at.attention_tree_step(*args, 4, [0, 1, 1], [-1, 0, 0], 1e-6, *nodes, split="f16",
                               xs=z((2, 2, 512), cp.uint16))
    with pytest.raises(ValueError, match="out"):
        at.attention_tree_step(*args, 4, [0, 1, 1], [-1, 0, 0], 1e-6, *nodes, out=z((3, 512), cp.float32),
                               split="f16")
    with pytest.raises(ValueError, match="xs"):  # bf16 has 3 parts
        at.attention_prefill_step(*args, 0, 1e-6, split="bf16", xs=z((3, 2, 512), cp.uint16))
    with pytest.raises(ValueError, match="xs"):
        at.attention_prefill_step(*args, 0, 1e-6, xs=z((3, 3, 512), cp.uint16))  # xs without split


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("split", [None, "f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_step_equals_the_launcher(shape: tuple[int, int, int, int], split: str | None, pdl: bool) -> None:
    """TreeStep (a verify plan's attention call: prebuilt argument blocks, plan.Relaunch) gives attention_tree_step's
    bits (the output, NaN / 0xFFFF-poisoned and rewritten each call, and the node rows) for committed lengths
    crossing chunk boundaries, two layers' steps of different node counts sharing one TreePartials (its buffers
    growing between calls, up to the cache's chunks); a start outside the cache raises; host tables, and partials
    too small for the cache, are refused."""
    from tandem.backend.cuda import plan

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    shared = at.TreePartials(-(-MAX_LEN // at.CHUNK))
    steps = []
    for parents in ([-1, 0, 1, 2, 1, 0, 5, 3], [-1] + [int(rng.integers(0, i)) for i in range(1, 32)]):
        n = len(parents)
        x = {k: cp.asarray(v) for k, v in _inputs(rng, shape, n, MAX_LEN - 40).items()}
        dep, par = cp.asarray(_depths(parents), dtype=cp.int32), cp.asarray(parents, dtype=cp.int32)
        freq = cp.asarray(ad.inv_freq(rd, THETA))
        node = [cp.full((n, hkv, d), np.nan, dtype=cp.float32) for _ in range(4)]
        args = (x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], freq, x["k_cache"], x["v_cache"], dep, par,
                EPS)
        step = at.TreeStep(*args, node[0], node[1], split=split, partials=shared)
        steps.append((step, args, node))
    saved = plan.use_pdl
    try:
        plan.use_pdl = pdl
        for start in [0, 5, 56, 57, 63, 64, 120, 200, 1000, MAX_LEN - 40]:
            for step, args, node in steps:
                step.result[...] = np.nan if split is None else POISON
                step(start)
                want = at.attention_tree_step(*args[:8], start, *args[8:], node[2], node[3], split=split)
                tag = f"{shape} split={split} pdl={pdl} n={step.n} start={start} seed={seed}"
                view = np.uint32 if split is None else np.uint16
                assert np.array_equal(cp.asnumpy(step.result).view(view), cp.asnumpy(want).view(view)), tag
                assert np.array_equal(cp.asnumpy(node[0]).view(np.uint32), cp.asnumpy(node[2]).view(np.uint32)), tag
                assert np.array_equal(cp.asnumpy(node[1]).view(np.uint32), cp.asnumpy(node[3]).view(np.uint32)), tag
    finally:
        plan.use_pdl = saved
    step, args, node = steps[0]
    for bad in (-1, MAX_LEN):
        with pytest.raises(ValueError, match="outside the cache"):
            step(bad)
    with pytest.raises(ValueError, match="device int32"):
        at.TreeStep(*args[:8], [0, 1, 2, 3, 2, 1, 2, 4], [-1, 0, 1, 2, 1, 0, 5, 3], EPS, node[0], node[1])
    with pytest.raises(ValueError, match="partials"):
        at.TreeStep(*args, node[0], node[1], partials=at.TreePartials(MAX_LEN // at.CHUNK - 1))
    assert shared._size[0] <= shared.max_chunks
    with pytest.raises(ValueError, match="chunks"):
        shared.parts(shared.max_chunks + 1, 8, d)
