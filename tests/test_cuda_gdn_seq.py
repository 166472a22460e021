"""CUDA GDN prefill / tree verify / commit (cuda/gdn_seq.cu) vs the NumPy references (numpy_ops composed as
Qwen3_5Model._gdn and qwen3_5/verify.py), and vs the decode step kernel (cuda/gdn_step.cu), on fresh random inputs.

Checks: y within relative 1e-4, the state and the per-node rows within 1e-5, the conv tail bitwise; the entry
state and tail untouched by verify (bitwise); verify-then-commit of a path equal to the prefill of that path;
prefill / tree nodes / commit equal to decode steps bit for bit (DESIGN.md: spec == plain); `gdn_decode` (two
launches) equal to `gdn_prefill` of one token bit for bit (y, state, tail) over consecutive steps; the split
outputs (`split=`) equal to gemv.prepare of y bit for bit; NaN-poisoned outputs fully written; ValueError on bad
arguments.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import gdn_seq as gq  # noqa: E402
from tandem.backend.cuda import gdn_step as gs  # noqa: E402
from tandem.backend.cuda import gemv  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from gdn_layer import Layer, Shape  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (Hk, Hv, dk, dv, K): the embedded default model's GDN, Qwen3.5-9B's and 27B's
SHAPES = [(4, 8, 64, 64, 4), (16, 32, 128, 128, 4), (16, 48, 128, 128, 4)]
# the other key head sizes the scan serves (gdn_seq.KEY_HEAD_SIZES): 32 (a lane holds one 32-row run; dv below and
# above 32 columns a warp), 256 (four lanes a state column)
HEAD_SIZE_SHAPES = [(4, 8, 32, 64, 4), (2, 8, 32, 128, 3), (2, 4, 256, 128, 4)]
# gdn_decode's block shapes: Hv / Hk of 1..4, dv below / above dk (prep's L2 sums over dv threads), one warp a
# block (dv 32, dk 64), several column groups a warp (dv > 8 · COLS), K of 2..5
DECODE_SHAPES = SHAPES + [(4, 16, 64, 32, 4), (2, 2, 64, 128, 2), (1, 4, 128, 64, 3), (2, 4, 128, 256, 4),
                          (1, 2, 64, 512, 5), (1, 1, 128, 1024, 4)] + HEAD_SIZE_SHAPES + [
                          (1, 1, 32, 32, 4), (1, 2, 32, 512, 4), (1, 2, 256, 32, 4), (1, 1, 256, 1024, 4)]
SPLITS = ["f16", "f16p", "bf16"]
EPS = 1e-6

def _prefill(ly: Layer, toks: tuple[np.ndarray, ...], tail: Any, state: Any) -> Any:
    mixed, a, b, z = (cp.asarray(t) for t in toks)
    y = cp.full((mixed.shape[0], ly.shape[1] * ly.shape[3]), np.nan, dtype=cp.float32)
    return gq.gdn_prefill(mixed, tail, ly.dev[0], a, b, ly.dev[1], ly.dev[2], z, ly.dev[3], state, ly.shape[0], EPS,
                          out=y, rows=ly.nan_rows(mixed.shape[0]))


def _err(got: np.ndarray, ref: np.ndarray) -> float:
    return max(rel_error(got, ref), max_rel_error(got, ref))


def _check_prefill(shape: Shape, num_tokens: int, name: str) -> None:
    """gdn_prefill of num_tokens fresh random tokens vs reference_prefill: y, state, conv tail (bitwise)."""
    seed = secrets.randbits(32)
    ly = Layer(np.random.default_rng(seed), shape)
    toks = ly.tokens(num_tokens)
    tail_d, state_d = cp.asarray(ly.tail), cp.asarray(ly.state)
    got = cp.asnumpy(_prefill(ly, toks, tail_d, state_d))
    tail, state = ly.tail.copy(), ly.state.copy()
    ref = gq.reference_prefill(toks[0], tail, ly.conv_w, toks[1], toks[2], ly.a_log, ly.dt_bias, toks[3], ly.norm_w,
                               state, shape[0], EPS)
    ey, es = _err(got, ref), rel_error(cp.asnumpy(state_d), state)
    assert ey <= 1e-4 and es <= 1e-5, f"{shape} T={num_tokens} seed={seed}: y {ey:.3g}, state {es:.3g}"
    assert np.array_equal(cp.asnumpy(tail_d), tail), f"{shape} T={num_tokens} seed={seed}: conv tail differs"
    record(f"{name}{list(shape)}", tokens=num_tokens, y_max_rel=ey, state_rel=es, seed=seed)


@pytest.mark.parametrize("num_tokens", [1, 7, 100])
@pytest.mark.parametrize("shape", SHAPES + HEAD_SIZE_SHAPES)
def test_gdn_prefill(shape: Shape, num_tokens: int) -> None:
    _check_prefill(shape, num_tokens, "gdn_prefill")


def test_gdn_prefill_long() -> None:
    """A 4096-token prompt (Qwen3.5-9B shape) vs the reference (its speed: bench/decode.py's TTFT)."""
    _check_prefill(SHAPES[1], 4096, "gdn_prefill_long")


def _decode(ly: Layer, toks: tuple[np.ndarray, ...], rows: list[int], tail: Any, state: Any) -> np.ndarray:
    """gdn_step.cu over toks[*][rows] one token a launch (tail and state in place); returns y [len(rows), Hv·dv]."""
    ys = [gs.gdn_decode_step(cp.asarray(toks[0][r]), tail, ly.dev[0], cp.asarray(toks[1][r]), cp.asarray(toks[2][r]),
                             ly.dev[1], ly.dev[2], cp.asarray(toks[3][r]), ly.dev[3], state, ly.shape[0], EPS)
          for r in rows]
    return np.stack([cp.asnumpy(y) for y in ys])


@pytest.mark.parametrize("shape", SHAPES[:2] + HEAD_SIZE_SHAPES)
def test_gdn_prefill_equals_decode_steps(shape: Shape) -> None:
    seed, num_tokens = secrets.randbits(32), 9
    ly = Layer(np.random.default_rng(seed), shape)
    toks = ly.tokens(num_tokens)
    tail_p, state_p, tail_d, state_d = (cp.asarray(x) for x in (ly.tail, ly.state, ly.tail, ly.state))
    got = cp.asnumpy(_prefill(ly, toks, tail_p, state_p))
    want = _decode(ly, toks, list(range(num_tokens)), tail_d, state_d)
    assert np.array_equal(got, want), f"{shape} seed={seed}: prefill y != decode steps (max |d| " \
        f"{np.abs(got - want).max():.3g})"
    assert cp.array_equal(state_p, state_d) and cp.array_equal(tail_p, tail_d), f"{shape} seed={seed}: state/tail"
    record(f"gdn_prefill_equals_decode{list(shape)}", tokens=num_tokens, bitwise=True, seed=seed)


def _trees(rng: np.random.Generator) -> dict[str, list[int]]:
    """A chain, a bush, a random tree of 32 nodes and a 64-node tree of depth ≥ 23 with branches on its spine."""
    chain = [-1] + list(range(15))
    bush = [-1] + [0] * 6 + [1, 2, 3, 7, 8, 9, 1, 13]
    rand = [-1] + [int(rng.integers(0, i)) for i in range(1, 32)]
    deep = [-1] + list(range(23)) + [int(rng.integers(0, i)) for i in range(24, 64)]
    return {"chain": chain, "bush": bush, "random32": rand, "deep64": deep}


def _depths(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def _path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _tree(ly: Layer, toks: tuple[np.ndarray, ...], parents: list[int], tail: Any, state: Any) -> tuple[Any, gq.GDNRows]:
    mixed, a, b, z = (cp.asarray(t) for t in toks)
    y = cp.full((len(parents), ly.shape[1] * ly.shape[3]), np.nan, dtype=cp.float32)
    return gq.gdn_tree(mixed, parents, tail, ly.dev[0], a, b, ly.dev[1], ly.dev[2], z, ly.dev[3], state, ly.shape[0],
                       EPS, out=y, rows=ly.nan_rows(len(parents)))


@pytest.mark.parametrize("kind", ["chain", "bush", "random32", "deep64"])
@pytest.mark.parametrize("shape", SHAPES + HEAD_SIZE_SHAPES)
def test_gdn_tree_and_commit(shape: Shape, kind: str) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    ly = Layer(rng, shape)
    parents = _trees(rng)[kind]
    n, r, tag = len(parents), shape[1] // shape[0], f"{shape} {kind} seed={seed}"
    toks = ly.tokens(n)
    tail_d, state_d = cp.asarray(ly.tail), cp.asarray(ly.state)
    y_d, rows = _tree(ly, toks, parents, tail_d, state_d)
    y_ref, k, v, g, beta = gq.reference_tree(toks[0], parents, ly.tail, ly.conv_w, toks[1], toks[2], ly.a_log,
                                             ly.dt_bias, toks[3], ly.norm_w, ly.state, shape[0], EPS)
    ey = _err(cp.asnumpy(y_d), y_ref)
    er = max(rel_error(cp.asnumpy(rows.k), k[:, ::r]), rel_error(cp.asnumpy(rows.v), v),
             rel_error(cp.asnumpy(rows.g), g), rel_error(cp.asnumpy(rows.beta), beta))
    assert ey <= 1e-4 and er <= 1e-5, f"{tag}: y {ey:.3g}, rows {er:.3g}"
    assert np.all(np.isfinite(cp.asnumpy(rows.q))), f"{tag}: rows.q not fully written"
    assert np.array_equal(cp.asnumpy(state_d), ly.state) and np.array_equal(cp.asnumpy(tail_d), ly.tail), \
        f"{tag}: verify modified the entry state or tail"

    depths = _depths(parents)
    path = _path_to(parents, int(np.argmax(depths)))
    gq.gdn_commit(rows, cp.asarray(toks[0]), path, tail_d, state_d)
    tail, state = ly.tail.copy(), ly.state.copy()
    gq.reference_commit(k, v, g, beta, toks[0], path, tail, state)
    es = rel_error(cp.asnumpy(state_d), state)
    assert es <= 1e-5 and np.array_equal(cp.asnumpy(tail_d), tail), f"{tag}: commit state {es:.3g} / tail"

    tail_p, state_p = cp.asarray(ly.tail), cp.asarray(ly.state)  # prefill of the path from the entry state
    y_p = cp.asnumpy(_prefill(ly, tuple(t[path] for t in toks), tail_p, state_p))
    ep, eyp = rel_error(cp.asnumpy(state_d), cp.asnumpy(state_p)), _err(cp.asnumpy(y_d)[path], y_p)
    assert ep <= 1e-5 and eyp <= 1e-5, f"{tag}: commit vs prefill of the path: state {ep:.3g}, y {eyp:.3g}"
    assert cp.array_equal(tail_p, tail_d), f"{tag}: commit vs prefill: tail"
    bitwise = bool(cp.array_equal(state_p, state_d)) and bool(np.array_equal(cp.asnumpy(y_d)[path], y_p))
    record(f"gdn_tree{list(shape)}", tree=kind, nodes=n, depth=max(depths), slots=gq.tree_plan(parents).num_slots,
           y_max_rel=ey, rows_rel=er, commit_state_rel=es, commit_vs_prefill_rel=ep, commit_vs_prefill_bitwise=bitwise,
           seed=seed)


@pytest.mark.parametrize("shape", SHAPES[:2] + HEAD_SIZE_SHAPES)
def test_gdn_tree_equals_decode_steps(shape: Shape) -> None:
    """Each node's y equals a decode of its path (gdn_step.cu) bit for bit, and so does the committed state."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    ly = Layer(rng, shape)
    parents = _trees(rng)["random32"][:16]
    toks = ly.tokens(len(parents))
    y_d, rows = _tree(ly, toks, parents, cp.asarray(ly.tail), cp.asarray(ly.state))
    got = cp.asnumpy(y_d)
    for node in range(len(parents)):
        path = _path_to(parents, node)
        tail, state = cp.asarray(ly.tail), cp.asarray(ly.state)
        want = _decode(ly, toks, path, tail, state)[-1]
        assert np.array_equal(got[node], want), f"{shape} seed={seed}: node {node} y != decode of its path"
    tail_c, state_c = cp.asarray(ly.tail), cp.asarray(ly.state)
    gq.gdn_commit(rows, cp.asarray(toks[0]), path, tail_c, state_c)
    assert cp.array_equal(state_c, state) and cp.array_equal(tail_c, tail), f"{shape} seed={seed}: commit != decode"
    record(f"gdn_tree_equals_decode{list(shape)}", nodes=len(parents), bitwise=True, seed=seed)


def test_gdn_seq_rejects_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    ly = Layer(np.random.default_rng(0), SHAPES[0])
    mixed, a, b, z = (cp.asarray(t) for t in ly.tokens(3))
    w = ly.dev
    tail, state = cp.asarray(ly.tail), cp.asarray(ly.state)

    def tree(parents: list[int], st: Any = state, hk: int = 4) -> Any:
        return gq.gdn_tree(mixed, parents, tail, w[0], a, b, w[1], w[2], z, w[3], st, hk, EPS)

    with pytest.raises(ValueError, match="num_k_heads"):
        gq.gdn_prefill(mixed, tail, w[0], a, b, w[1], w[2], z, w[3], state, 3, EPS)
    with pytest.raises(ValueError, match="dk"):
        gq.gdn_prefill(mixed, tail, w[0], a, b, w[1], w[2], z, w[3], cp.zeros((8, 48, 64), cp.float32), 4, EPS)
    with pytest.raises(ValueError, match="a:"):
        gq.gdn_prefill(mixed, tail, w[0], a[:2], b, w[1], w[2], z, w[3], state, 4, EPS)
    with pytest.raises(ValueError, match="parent_ids"):
        tree([0, 0, 1])
    with pytest.raises(ValueError, match="parent_ids"):
        tree([-1, 2, 0])
    with pytest.raises(ValueError, match="parent_ids"):
        tree([-1, 0])
    monkeypatch.setattr(gq, "max_slots", lambda dk, dv: 0)
    with pytest.raises(ValueError, match="saved state tiles"):
        tree([-1, 0, 0])
    monkeypatch.undo()
    y, rows = tree([-1, 0, 0])
    with pytest.raises(ValueError, match="path"):
        gq.gdn_commit(rows, mixed, [], tail, state)
    with pytest.raises(ValueError, match="path"):
        gq.gdn_commit(rows, mixed, [0, 3], tail, state)
    with pytest.raises(ValueError, match="mixed"):
        gq.gdn_commit(rows, mixed[:2], [0, 1], tail, state)


def _decode_one(ly: Layer, row: tuple[np.ndarray, ...], tail: Any, state: Any, split: str | None = None,
                u: Any = None) -> Any:
    """gdn_decode of one token (row: mixed, a, b, z of 1 row each) into a poisoned y (NaN) or xs (0xFFFF: NaN in
    fp16 and bf16)."""
    mixed, a, b, z = (cp.asarray(t) for t in row)
    width = ly.shape[1] * ly.shape[3]
    if split is None:
        y = cp.full((1, width), np.nan, dtype=cp.float32)
        return gq.gdn_decode(mixed, tail, ly.dev[0], a, b, ly.dev[1], ly.dev[2], z, ly.dev[3], state, ly.shape[0],
                             EPS, out=y, u=u)
    xs = cp.full((1, gemv.PARTS[split], width), 0xFFFF, dtype=cp.uint16)
    return gq.gdn_decode(mixed, tail, ly.dev[0], a, b, ly.dev[1], ly.dev[2], z, ly.dev[3], state, ly.shape[0], EPS,
                         split=split, xs=xs, u=u)


@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_gdn_decode_equals_prefill(shape: Shape) -> None:
    """Decode steps (two launches each) == one-token prefills bit for bit (y, state, tail), and both == the
    reference over the steps."""
    seed, steps = secrets.randbits(32), 5
    ly = Layer(np.random.default_rng(seed), shape)
    toks = ly.tokens(steps)
    tail_p, state_p, tail_d, state_d = (cp.asarray(x) for x in (ly.tail, ly.state, ly.tail, ly.state))
    u = cp.full((1, ly.c), np.nan, dtype=cp.float32)
    ys = []
    for t in range(steps):
        row = tuple(x[t:t + 1] for x in toks)
        y_p = cp.asnumpy(_prefill(ly, row, tail_p, state_p))
        y_d = cp.asnumpy(_decode_one(ly, row, tail_d, state_d, u=u if t else None))
        tag = f"{shape} step {t} seed={seed}"
        assert np.array_equal(y_d, y_p), f"{tag}: decode y != prefill y (max |d| {np.nanmax(np.abs(y_d - y_p)):.3g}, " \
            f"{int(np.isnan(y_d).sum())} NaN)"
        assert cp.array_equal(state_d, state_p), f"{tag}: decode state != prefill state"
        assert cp.array_equal(tail_d, tail_p), f"{tag}: decode tail != prefill tail"
        ys.append(y_d[0])
    assert np.all(np.isfinite(cp.asnumpy(u))), f"{shape} seed={seed}: u not fully written"
    tail, state = ly.tail.copy(), ly.state.copy()
    ref = gq.reference_prefill(toks[0], tail, ly.conv_w, toks[1], toks[2], ly.a_log, ly.dt_bias, toks[3], ly.norm_w,
                               state, shape[0], EPS)
    ey, es = _err(np.stack(ys), ref), rel_error(cp.asnumpy(state_d), state)
    assert ey <= 1e-4 and es <= 1e-5, f"{shape} seed={seed}: vs reference y {ey:.3g}, state {es:.3g}"
    assert np.array_equal(cp.asnumpy(tail_d), tail), f"{shape} seed={seed}: conv tail differs from the reference"
    record(f"gdn_decode{list(shape)}", steps=steps, bitwise_vs_prefill=True, y_max_rel=ey, state_rel=es, seed=seed)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("shape", SHAPES[:2] + HEAD_SIZE_SHAPES[:1])
def test_gdn_split_outputs_equal_prepare(shape: Shape, split: str) -> None:
    """decode / prefill / tree with `split` write gemv.prepare(y, split) bit for bit, and the same state / tail."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    ly = Layer(rng, shape)
    tag = f"{shape} {split} seed={seed}"
    toks = ly.tokens(16)
    tail_y, state_y, tail_s, state_s = (cp.asarray(x) for x in (ly.tail, ly.state, ly.tail, ly.state))
    for t in range(3):  # decode steps
        row = tuple(x[t:t + 1] for x in toks)
        y = _decode_one(ly, row, tail_y, state_y)
        xs = _decode_one(ly, row, tail_s, state_s, split=split)
        assert cp.array_equal(xs, gemv.prepare(y, split)), f"{tag}: decode step {t} xs != prepare(y)"
        assert cp.array_equal(state_s, state_y) and cp.array_equal(tail_s, tail_y), f"{tag}: decode state / tail"

    mixed, a, b, z = (cp.asarray(x[3:10]) for x in toks)  # a 7-token prefill
    w, hk, width, parts = ly.dev, shape[0], shape[1] * shape[3], gemv.PARTS[split]
    y = _prefill(ly, tuple(x[3:10] for x in toks), tail_y, state_y)
    xs = cp.full((7, parts, width), 0xFFFF, dtype=cp.uint16)
    got = gq.gdn_prefill(mixed, tail_s, w[0], a, b, w[1], w[2], z, w[3], state_s, hk, EPS, split=split, xs=xs)
    assert got is xs and cp.array_equal(xs, gemv.prepare(y, split)), f"{tag}: prefill xs != prepare(y)"
    assert cp.array_equal(state_s, state_y) and cp.array_equal(tail_s, tail_y), f"{tag}: prefill state / tail"

    parents = _trees(rng)["random32"][:16]
    y_t, _ = _tree(ly, toks, parents, tail_y, state_y)
    mixed, a, b, z = (cp.asarray(x) for x in toks)
    xs = cp.full((16, parts, width), 0xFFFF, dtype=cp.uint16)
    got, rows = gq.gdn_tree(mixed, parents, tail_s, w[0], a, b, w[1], w[2], z, w[3], state_s, hk, EPS,
                            rows=ly.nan_rows(16), split=split, xs=xs)
    assert got is xs and cp.array_equal(xs, gemv.prepare(y_t, split)), f"{tag}: tree xs != prepare(y)"
    assert np.all(np.isfinite(cp.asnumpy(rows.k))), f"{tag}: tree rows not written with split"
    record(f"gdn_split{list(shape)}", split=split, bitwise=True, seed=seed)


def test_gdn_decode_rejects_bad_arguments() -> None:
    ly = Layer(np.random.default_rng(0), SHAPES[0])
    mixed, a, b, z = (cp.asarray(t) for t in ly.tokens(2))
    w, tail, state = ly.dev, cp.asarray(ly.tail), cp.asarray(ly.state)

    def decode(n: int = 1, **kw: Any) -> Any:
        return gq.gdn_decode(mixed[:n], tail, w[0], a[:n], b[:n], w[1], w[2], z[:n], w[3], state, 4, EPS, **kw)

    with pytest.raises(ValueError, match="one token"):
        decode(2)
    with pytest.raises(ValueError, match="split"):
        decode(split="fp8")
    with pytest.raises(ValueError, match="xs"):
        decode(split="bf16", xs=cp.zeros((1, 2, 8 * 64), cp.uint16))
    with pytest.raises(ValueError, match="xs"):
        decode(xs=cp.zeros((1, 2, 8 * 64), cp.uint16))
    with pytest.raises(ValueError, match="u:"):
        decode(u=cp.zeros((ly.c,), cp.float32))
    with pytest.raises(ValueError, match="dk"):
        gq.gdn_decode(mixed[:1], tail, w[0], a[:1], b[:1], w[1], w[2], z[:1], w[3], cp.zeros((8, 48, 64), cp.float32),
                      4, EPS)
    with pytest.raises(ValueError, match="split"):
        gq.gdn_prefill(mixed, tail, w[0], a, b, w[1], w[2], z, w[3], state, 4, EPS, split="f32")
