"""Decode and tree-verify attention on tensor cores (cuda/attention_tc.cu, tandem/backend/cuda/attention_tc.py) on a
GPU, bf16 KV rows, Qwen3.5-27B's attention shape (24 query heads, 4 KV heads, head dim 256) and the small models'.

Checks: the verify kernel over prepared q (attention_tc_rows) within 2e-5 relative of the NumPy twin
(reference_tc_decode: float64 products for the MMAs) and 5e-5 of float64 attention at 1k, 32k and 128k keys;
decode (prep, row written at pos) within 2e-4 of attention_decode.reference_step (the new k row's bf16 rounding
may differ from NumPy's, as for the cuda-core bf16 path), its v row stored as f32_to_bf16 and no row past pos
written; tree rows == decode rows bit for bit (16- and 32-node trees, committed lengths on and off the 64 grid, 1k
and 32k, k / v rows too); a node's bits the same in trees of other sizes (row independence); DecodeStep / TreeStep
with tensor_cores == the unplanned launchers; the model with DECODE_ATTENTION = "tensor_cores": verify rows ==
plain decodes, spec == plain greedy, replayed plans == unplanned launches. Caches past the written rows are
NaN-poisoned (0xFFFF bits), outputs NaN-filled before the launch.
Run: python3 -m pytest -q -n 8 tests/test_cuda_attention_tc.py
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import plain_decodes, root_path  # noqa: E402
from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import attention_switch as sw  # noqa: E402
from tandem.backend.cuda import attention_tc as tc  # noqa: E402
from tandem.backend.cuda import attention_tree as at  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error, record, rel_error  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402
from test_attention_tc_twin import _f64_attention  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

SHAPES = [(6, 2, 64, 16), (24, 4, 256, 64)]  # (H, Hkv, D, rotary dims): the default model's, Qwen3.5-27B's
BIG = SHAPES[1]
THETA, EPS = 1e7, 1e-6


def _cache(rng: np.random.Generator, rows: int, filled: int, hkv: int, d: int) -> np.ndarray:
    """bf16 bits [rows, Hkv, D]: the first `filled` rows random, the rest 0xFFFF (NaN)."""
    c = np.full((rows, hkv, d), 0xFFFF, dtype=np.uint16)
    c[:filled] = f32_to_bf16(rng.standard_normal((filled, hkv, d)).astype(np.float32))
    return c


def _step_args(rng: np.random.Generator, shape: tuple[int, int, int, int], n: int) -> dict[str, Any]:
    h, hkv, d, _ = shape
    return {"qg": rng.standard_normal((n, h, 2 * d)).astype(np.float32),
            "k_new": rng.standard_normal((n, hkv, d)).astype(np.float32),
            "v_new": rng.standard_normal((n, hkv, d)).astype(np.float32),
            "q_norm": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
            "k_norm": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)}


def _tree(rng: np.random.Generator, n: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]  # deep and bushy
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return parents, depths


def _bits(a: Any) -> np.ndarray:
    host: np.ndarray = cp.asnumpy(a)
    return host.view(np.uint32) if host.dtype == np.float32 else host


@pytest.mark.parametrize("start", [1000, 32767, 131071])
def test_verify_kernel_against_the_twin(start: int) -> None:
    """attn_tc_tree + attn_combine over prepared q (a 3-node chain at start: positions start .. start + 2) against
    the twin and float64 over each node's rows."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, _ = BIG
    parents, n = [-1, 0, 1], 3
    kc, vc = _cache(rng, start + 8, start, hkv, d), _cache(rng, start + 8, start, hkv, d)
    nk, nv = _cache(rng, n, n, hkv, d), _cache(rng, n, n, hkv, d)
    q = (2.0 * rng.standard_normal((n, h, d))).astype(np.float32)
    got = cp.asnumpy(tc.attention_tc_rows(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cp.asarray(nk),
                                          cp.asarray(nv), start, [0, 1, 2], parents))
    for i in range(n):
        keys = bf16_to_f32(np.concatenate([kc[:start], nk[:i + 1]]))
        values = bf16_to_f32(np.concatenate([vc[:start], nv[:i + 1]]))
        twin = tc.reference_tc_decode(q[i], keys, values)
        exact = _f64_attention(q[i], keys, values)
        e_twin, e_f64 = max_rel_error(got[i], twin), max_rel_error(got[i], exact)
        tag = f"P={start} node {i} seed={seed}"
        assert e_twin <= 2e-5 and rel_error(got[i], twin) <= 2e-5, f"{tag}: vs twin {e_twin:.3g}"
        assert e_f64 <= 5e-5, f"{tag}: vs float64 {e_f64:.3g}"
        record(f"attention_tc_rows[P={start},node={i}]", twin=e_twin, f64=e_f64, seed=seed)


@pytest.mark.parametrize("pos", [0, 63, 64, 1000, 32767, 131071])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_against_the_reference(shape: tuple[int, int, int, int], pos: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    x = _step_args(rng, shape, 1)
    kc, vc = _cache(rng, pos + 70, pos, hkv, d), _cache(rng, pos + 70, pos, hkv, d)
    dk, dv = cp.asarray(kc), cp.asarray(vc)
    y = cp.full((h * d,), np.nan, dtype=cp.float32)
    sw.attention_decode_step(cp.asarray(x["qg"][0]), cp.asarray(x["k_new"][0]), cp.asarray(x["v_new"][0]),
                             cp.asarray(x["q_norm"]), cp.asarray(x["k_norm"]), cp.asarray(ad.inv_freq(rd, THETA)), dk,
                             dv, pos, EPS, out=y, tensor_cores=True)
    want = ad.reference_step(x["qg"][0], x["k_new"][0], x["v_new"][0], x["q_norm"], x["k_norm"], rd, THETA, kc, vc,
                             pos, EPS)
    got = cp.asnumpy(y)
    tag = f"{shape} pos={pos} seed={seed}"
    assert rel_error(got, want) <= 2e-4 and max_rel_error(got, want) <= 2e-4, \
        f"{tag}: rel {rel_error(got, want):.3g} max {max_rel_error(got, want):.3g}"
    assert np.array_equal(cp.asnumpy(dv[pos]), f32_to_bf16(x["v_new"][0])), f"{tag}: v row"
    assert max_rel_error(bf16_to_f32(cp.asnumpy(dk[pos])), bf16_to_f32(kc[pos])) <= 2.0 ** -7, f"{tag}: k row"
    assert np.array_equal(cp.asnumpy(dk[pos + 1:]), kc[pos + 1:]), f"{tag}: rows past pos written"
    assert np.array_equal(cp.asnumpy(dk[:pos]), kc[:pos]) and np.array_equal(cp.asnumpy(dv[:pos]), vc[:pos])
    record(f"attention_tc_decode{list(shape)}[pos={pos}]", rel=rel_error(got, want), seed=seed)


def _tree_rows(x: dict[str, Any], freq: Any, kc: Any, vc: Any, start: int, parents: list[int], depths: list[int],
               nodes: int) -> tuple[np.ndarray, Any, Any]:
    """attention_tree_step with tensor_cores over the first `nodes` nodes: (y host [N, H·D], node_k, node_v)."""
    hkv, d = int(kc.shape[1]), int(kc.shape[2])
    node_k = cp.empty((nodes, hkv, d), dtype=cp.uint16)
    node_v = cp.empty((nodes, hkv, d), dtype=cp.uint16)
    y = cp.full((nodes, x["qg"].shape[1] * d), np.nan, dtype=cp.float32)
    sw.attention_tree_step(x["qg"][:nodes], x["k_new"][:nodes], x["v_new"][:nodes], x["q_norm"], x["k_norm"], freq, kc,
                           vc, start, depths[:nodes], parents[:nodes], EPS, node_k, node_v, out=y, tensor_cores=True)
    return cp.asnumpy(y), node_k, node_v


@pytest.mark.parametrize("nodes", [16, 32])
@pytest.mark.parametrize("start", [1000, 1024, 32752])
@pytest.mark.parametrize("shape", SHAPES)
def test_tree_rows_equal_decode_rows(shape: tuple[int, int, int, int], start: int, nodes: int) -> None:
    """Each node's output and k / v rows have the bits of a tensor-core decode at its position over its path (the
    path's rows committed first); P = 32752 puts deep nodes past the 32768 unit boundary."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = shape
    parents, depths = _tree(rng, nodes)
    x = {k: cp.asarray(v) for k, v in _step_args(rng, shape, nodes).items()}
    kc0, vc0 = (cp.asarray(_cache(rng, start + 64, start, hkv, d)) for _ in range(2))
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    y, node_k, node_v = _tree_rows(x, freq, kc0, vc0, start, parents, depths, nodes)
    for i in range(nodes):
        path = root_path(parents, i)
        kc, vc = kc0.copy(), vc0.copy()
        at.attention_commit(kc, vc, node_k, node_v, start, path[:-1])
        pos = start + len(path) - 1
        row = sw.attention_decode_step(x["qg"][i], x["k_new"][i], x["v_new"][i], x["q_norm"], x["k_norm"], freq, kc,
                                       vc, pos, EPS, tensor_cores=True)
        tag = f"{shape} P={start} N={nodes} node {i} pos {pos} seed={seed}"
        assert np.array_equal(_bits(row), y[i].view(np.uint32)), tag
        assert np.array_equal(_bits(kc[pos]), _bits(node_k[i])), f"{tag}: k row differs from decode's"
        assert np.array_equal(_bits(vc[pos]), _bits(node_v[i])), f"{tag}: v row differs from decode's"


@pytest.mark.parametrize("start", [1000, 32752])
def test_a_node_has_the_same_bits_in_any_tree(start: int) -> None:
    """Row independence: the first 5 / 16 nodes of a 32-node tree give the same bits alone as inside it (other node
    groups of the shared blocks, other tail blocks, other grids)."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = BIG
    parents, depths = _tree(rng, 32)
    x = {k: cp.asarray(v) for k, v in _step_args(rng, BIG, 32).items()}
    kc, vc = (cp.asarray(_cache(rng, start + 64, start, hkv, d)) for _ in range(2))
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    full, _, _ = _tree_rows(x, freq, kc, vc, start, parents, depths, 32)
    for n in (1, 5, 16):
        part, _, _ = _tree_rows(x, freq, kc, vc, start, parents, depths, n)
        assert np.array_equal(part.view(np.uint32), full[:n].view(np.uint32)), f"P={start} first {n} seed={seed}"


def test_steps_equal_the_launchers() -> None:
    """DecodeStep / TreeStep with tensor_cores (prebuilt arguments, grids following the position) give the unplanned
    launchers' bits: outputs (split operand too), cache rows and node rows, across unit boundaries."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    h, hkv, d, rd = BIG
    max_len = 5000
    x = {k: cp.asarray(v) for k, v in _step_args(rng, BIG, 8).items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    kc, vc = (cp.asarray(_cache(rng, max_len, max_len, hkv, d)) for _ in range(2))
    kd, vd = kc.copy(), vc.copy()
    one = (x["qg"][0], x["k_new"][0], x["v_new"][0], x["q_norm"], x["k_norm"], freq)
    step = sw.decode_step(*one, kc, vc, EPS, tensor_cores=True)
    split = sw.decode_step(*one, kc, vc, EPS, split="bf16", tensor_cores=True)
    y = cp.empty((h * d,), dtype=cp.float32)
    for pos in (0, 63, 64, 700, 4095, 4096, 100):
        step.result[...] = np.nan
        step(pos)
        sw.attention_decode_step(*one, kd, vd, pos, EPS, out=y, tensor_cores=True)
        assert np.array_equal(_bits(step.result), _bits(y)), f"pos {pos} seed={seed}"
        split(pos)
        xs = sw.attention_decode_step(*one, kd, vd, pos, EPS, split="bf16", tensor_cores=True)
        assert np.array_equal(_bits(split.result), _bits(xs)), f"split, pos {pos} seed={seed}"
        assert np.array_equal(_bits(kc), _bits(kd)) and np.array_equal(_bits(vc), _bits(vd)), f"caches, pos {pos}"
    parents = [-1, 0, 1, 2, 1, 0, 5, 3]
    depths = [0, 1, 2, 3, 2, 1, 2, 4]
    dep, par = cp.asarray(depths, dtype=cp.int32), cp.asarray(parents, dtype=cp.int32)
    nodes = [tuple(cp.empty((8, hkv, d), dtype=cp.uint16) for _ in range(2)) for _ in range(2)]
    args = (x["qg"], x["k_new"], x["v_new"], x["q_norm"], x["k_norm"], freq, kc, vc)
    tree = sw.tree_step(*args, dep, par, EPS, *nodes[0], tensor_cores=True)
    for start in (0, 100, 1000, 1024, 4090, 2000):
        tree.result[...] = np.nan
        tree(start)
        want = sw.attention_tree_step(*args, start, depths, parents, EPS, *nodes[1], tensor_cores=True)
        tag = f"start={start} seed={seed}"
        assert np.array_equal(_bits(tree.result), _bits(want)), tag
        assert np.array_equal(_bits(nodes[0][0]), _bits(nodes[1][0])), tag
        assert np.array_equal(_bits(nodes[0][1]), _bits(nodes[1][1])), tag


def test_fp32_caches_keep_the_cuda_core_kernels() -> None:
    """tensor_cores on fp32 caches: today's kernels, today's bits."""
    rng = np.random.default_rng(2)
    h, hkv, d, rd = BIG
    x = {k: cp.asarray(v) for k, v in _step_args(rng, BIG, 1).items()}
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    kc = cp.asarray(rng.standard_normal((300, hkv, d)).astype(np.float32))
    vc = cp.asarray(rng.standard_normal((300, hkv, d)).astype(np.float32))
    one = (x["qg"][0], x["k_new"][0], x["v_new"][0], x["q_norm"], x["k_norm"], freq)
    a = sw.attention_decode_step(*one, kc.copy(), vc.copy(), 200, EPS, tensor_cores=True)
    b = ad.attention_decode_step(*one, kc.copy(), vc.copy(), 200, EPS)
    assert np.array_equal(_bits(a), _bits(b))
    assert not tc.supported(kc, h // hkv)


# ------------------------------------------------------------------------------------------ the model
TINY = dict(layers=4, hidden=512, mlp=1024, vocab=1024, heads=4, kv_heads=2, head_dim=64, gdn_k_heads=4,
            gdn_v_heads=8, gdn_dim=64, conv_taps=4, attn_every=2, rotary_dim=16)


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def model(request: pytest.FixtureRequest) -> Any:
    from bench.decode import build

    cp.random.seed(1)
    m = build(request.param, TINY, kv_dtype="bfloat16")
    m.DECODE_ATTENTION = "tensor_cores"  # this instance only
    assert m._tc_attention()
    return m


@pytest.fixture()
def tc_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of TcDecodeStep / TcTreeStep calls (the switch must reach every launcher)."""
    counts = {"decode": 0, "tree": 0}
    for cls, key in ((tc.TcDecodeStep, "decode"), (tc.TcTreeStep, "tree")):
        orig = cls.__call__

        def counted(self: Any, pos: int, _orig: Any = orig, _key: str = key) -> None:
            counts[_key] += 1
            _orig(self, pos)

        monkeypatch.setattr(cls, "__call__", counted)
    return counts


@pytest.mark.parametrize("parents", [[-1], [-1, 0, 1, 1, 0], [-1, 0, 1, 2, 1, 0, 5, 3, 7, 8, 8, 2, 11, 12, 0, 14]],
                         ids=["n1", "n5", "n16"])
def test_model_verify_rows_are_plain_decodes(model: Any, parents: list[int], tc_calls: dict[str, int]) -> None:
    """With the switch on, every verify row (recorded and replayed) equals a plain decode of its node's path bit for
    bit, and the commit of a path leaves the plain decodes' state."""
    from device_helpers import assert_states_equal

    rng = np.random.default_rng(len(parents))
    prompt = rng.integers(0, TINY["vocab"], 150).tolist()  # past two 64-key units
    tokens = rng.integers(0, TINY["vocab"], len(parents)).tolist()
    state = model.new_state(len(prompt) + 24)
    model.prefill(state, prompt)
    scratch = model.new_tree_scratch(16)
    got = [cp.asnumpy(model.verify_tree(state, scratch, tokens, parents)) for _ in range(3)]  # record, replay x2
    for g in got[1:]:
        np.testing.assert_array_equal(g.view(np.uint32), got[0].view(np.uint32), err_msg="replay")
    for node in range(len(parents)):
        _, want = plain_decodes(model, prompt, [tokens[n] for n in root_path(parents, node)])
        np.testing.assert_array_equal(got[0][node].view(np.uint32), cp.asnumpy(want).view(np.uint32),
                                      err_msg=f"node {node}")
    path = root_path(parents, len(parents) - 1)
    model.commit(state, scratch, path)
    ref, _ = plain_decodes(model, prompt, [tokens[n] for n in path])
    assert_states_equal(state, ref)
    assert tc_calls["decode"] > 0 and tc_calls["tree"] > 0, tc_calls  # both verbs ran the tensor-core kernels


def test_model_spec_equals_plain_greedy(model: Any) -> None:
    """Greedy speculation (trees holding the plain continuation's next tokens beside wrong guesses, accepted by the
    verify's own argmax, committed) writes the plain greedy tokens, and its last logits equal plain decode's."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, TINY["vocab"], 100).tolist()
    steps = 40
    state = model.new_state(len(prompt) + steps + 40)
    logits = model.prefill(state, prompt)
    plain = []
    for _ in range(steps):
        plain.append(int(cp.argmax(logits)))
        logits = model.decode(state, plain[-1])
    spec_state = model.new_state(len(prompt) + steps + 40)
    first = model.prefill(spec_state, prompt)
    out = [int(cp.argmax(first))]
    scratch = model.new_tree_scratch(16)
    parents = [-1, 0, 1, 2, 0, 4, 1]  # root = the last committed token; a chain of guesses, a wrong branch, a leaf
    while len(out) < steps:
        k = len(out)
        truth = plain[k:k + 3] + [0] * 3
        guess = [int(t) if rng.random() < 0.7 else int(rng.integers(0, TINY["vocab"])) for t in truth[:3]]
        wrong = [int(t) for t in rng.integers(0, TINY["vocab"], 3)]
        tokens = [out[-1], guess[0], guess[1], guess[2], wrong[0], wrong[1], wrong[2]]
        vlog = cp.asnumpy(model.verify_tree(spec_state, scratch, tokens, parents))
        node, path = 0, [0]
        while True:  # the longest path where the model's choice equals the guess
            choice = int(np.argmax(vlog[node]))
            nxt = [c for c in range(len(parents)) if parents[c] == node and tokens[c] == choice]
            if not nxt:
                break
            node = nxt[0]
            path.append(node)
        model.commit(spec_state, scratch, path)
        out += [tokens[n] for n in path[1:]] + [int(np.argmax(vlog[node]))]
    assert out[:steps] == plain, "speculative tokens differ from plain greedy"


def test_model_planned_decode_equals_the_launchers(model: Any) -> None:
    """The recorded decode plan replayed across unit boundaries (64, 128) gives the unplanned launchers' logits bit
    for bit, with tensor-core attention in the plan."""
    prompt = list(range(40))
    assert model._plannable()

    def run(plannable: bool) -> tuple[list[np.ndarray], Any]:
        model._plannable_cache = plannable
        try:
            state = model.new_state(200)
            logits = model.prefill(state, prompt)
            steps = []
            for _ in range(100):
                logits = model.decode(state, int(cp.argmax(logits)))
                steps.append(cp.asnumpy(logits).copy())
            return steps, state
        finally:
            model._plannable_cache = None

    planned, s1 = run(True)
    assert s1.decode_plan is not None
    plain, s2 = run(False)
    for i, (a, b) in enumerate(zip(planned, plain)):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=f"decode step {i}")
    from device_helpers import assert_states_equal

    assert_states_equal(s1, s2)
