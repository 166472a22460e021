"""The NumPy prefill is row-invariant with decode (issue 36, item 4): a prompt prefilled in one pass, in pieces of
any size, or token by token by decode leaves the same state bits (every GDN recurrent state and conv tail, every
attention K/V row) and gives the same logits and hidden rows, for every weight format and the MoE adapter.

Sources: tandem/formats/linear.py (one GEMV per row from fixed buffers), tandem/backend/numpy_ops.py
(``attention_rows``, ``gdn_step`` / ``gdn_rows``), tandem/models/qwen3_5/model.py and mtp.py. The first tests check
that a Linear's rows are one GEMV each, so a change that breaks it fails here by name rather than as a cache mismatch
elsewhere; tests/test_row_invariance_cores.py runs the row checks under several forced OpenBLAS core types.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import row_checks
from tandem.backend import numpy_ops as ops
from tandem.backend.numpy_ops import GDN_CHUNK, KEY_BLOCK
from tandem.formats import DenseLinear, FP8BlockLinear, NVFP4Linear, quantize_nvfp4
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.qwen3_5_moe.model import Qwen3_5MoeModel
from tandem.models.qwen3_next.model import Qwen3NextModel
from tools.make_checkpoint import write_checkpoint
from tools.make_moe_checkpoint import write_moe_checkpoint

# The embedded model's projection shapes [out, in], a larger one, narrow and ragged ones.
SHAPES = [(1024, 384), (512, 384), (8, 384), (384, 512), (640, 384), (384, 640), (768, 384), (128, 384),
          (384, 384), pytest.param((12288, 384), marks=pytest.mark.slow), (96, 64), (7, 5), (1000, 384), (5, 64),
          (1, 64)]  # the large one: seconds of GEMVs, no compiled module on its path
CUTS = sorted({1, GDN_CHUNK - 1, GDN_CHUNK, GDN_CHUNK + 1, 2 * GDN_CHUNK - 1, 2 * GDN_CHUNK, 2 * GDN_CHUNK + 1,
               KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1})
N = KEY_BLOCK + 12


# ------------------------------------------------------------------------------------------------ the BLAS
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matmul_rows_are_one_gemv_each(shape: tuple[int, int]) -> None:
    """Row i of any call (any row count, any cut, a strided or misaligned x) is np.dot(W, x[i]) from a fixed
    buffer, bit for bit, and close to the float64 product."""
    rng = np.random.default_rng(shape[0])
    lin = DenseLinear(rng.standard_normal(shape).astype(np.float32))
    assert lin.weight.shape == shape and lin.weight.flags["C_CONTIGUOUS"]
    assert lin.bytes_per_use == shape[0] * shape[1] * 4
    x = rng.standard_normal((70, shape[1])).astype(np.float32)
    row = np.empty(shape[1], np.float32)
    gemv = np.empty((70, shape[0]), np.float32)
    for i in range(70):
        row[...] = x[i]
        gemv[i] = np.dot(lin.weight, row)
    cuts = [(0, 1), (1, 4), (3, 68), (5, 38), (0, 64)] + [(9, 9 + n) for n in range(2, 34)]
    single = row_checks.linear_rows(lin, x, cuts)  # any row count, cut, strided or misaligned x
    assert np.array_equal(single, gemv), shape
    ref = x.astype(np.float64) @ lin.weight.astype(np.float64).T
    np.testing.assert_allclose(single, ref, rtol=1e-4, atol=1e-3)


def test_linear_rows_are_the_same_from_another_thread() -> None:
    """Each thread has its own fixed buffers: rows computed on another thread have the same bits."""
    rng = np.random.default_rng(11)
    lin = DenseLinear(rng.standard_normal((640, 384)).astype(np.float32))
    x = rng.standard_normal((9, 384)).astype(np.float32)
    here = lin.matmul(x)
    there: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: there.append(lin.matmul(x)))
    worker.start()
    worker.join()
    assert np.array_equal(there[0], here)


def _former_gdn_step(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                     beta: np.ndarray) -> np.ndarray:
    """The delta-rule step with the rank-1 update as an elementwise broadcast product."""
    state *= np.exp(g)[:, None, None]
    p = np.matmul(k[:, None, :], state)[:, 0]
    delta = beta[:, None] * (v - p)
    state += k[:, :, None] * delta[:, None, :]
    return np.asarray(np.matmul(q[:, None, :], state)[:, 0], dtype=np.float32)


@pytest.mark.parametrize("hv,dk,dv", [(8, 64, 64), (4, 16, 16), (32, 16, 8), (6, 8, 24), (5, 16, 16), (8, 128, 128),
                                      pytest.param(1, 1024, 1000, marks=pytest.mark.slow)])
def test_gdn_rows_give_gdn_steps_bits(hv: int, dk: int, dv: int) -> None:
    """gdn_rows over T tokens == gdn_step token by token (outputs and state, bit for bit) == the elementwise
    rank-1 update (the block-diagonal GEMM's products are exact), for head groups of 8, 4, 6 and 5 heads, and heads
    too large for the small kernel (the elementwise update itself)."""
    t = 70
    q, k, v, g, beta, start = row_checks.gdn_inputs(np.random.default_rng(hv * dk + dv), t, hv, dk, dv)
    o_rows, rows = row_checks.gdn_rows_are_steps(q, k, v, g, beta, start)
    former = start.copy()
    o_former = np.stack([_former_gdn_step(former, q[i], k[i], v[i], g[i], beta[i]) for i in range(t)])
    assert np.array_equal(o_rows, o_former) and np.array_equal(rows, former)
    assert np.array_equal(np.exp(g), np.stack([np.exp(row) for row in g]))  # the decay of a piece at once
    part = start.copy()  # a piece split anywhere goes on alike
    o_part = np.concatenate([ops.gdn_rows(part, q[:33], k[:33], v[:33], g[:33], beta[:33]),
                             ops.gdn_rows(part, q[33:], k[33:], v[33:], g[33:], beta[33:])])
    assert np.array_equal(o_part, o_rows) and np.array_equal(part, rows)


@pytest.mark.parametrize("length", [40, KEY_BLOCK, KEY_BLOCK + 30, 3 * KEY_BLOCK + 1])
def test_attention_rows_depend_on_their_query_and_visible_rows_only(length: int) -> None:
    """Rows of one call equal one-row calls and calls over a longer buffer whose rows past each position hold
    other finite values; and all equal the batched causal reference within fp32 rounding."""
    rng = np.random.default_rng(length)
    t = min(length, 70)
    keys = rng.standard_normal((length, 2, 32)).astype(np.float32)
    values = rng.standard_normal((length, 2, 32)).astype(np.float32)
    q = rng.standard_normal((t, 6, 32)).astype(np.float32)
    pos = np.arange(length - t, length)
    got = row_checks.attention_rows_are_one_row_calls(q, keys, values, pos)
    longer_k = np.concatenate([keys, rng.standard_normal((300, 2, 32)).astype(np.float32)])
    longer_v = np.concatenate([values, rng.standard_normal((300, 2, 32)).astype(np.float32)])
    for r in range(t):
        assert np.array_equal(got[r], ops.attention_rows(q[r:r + 1], longer_k, longer_v, pos[r:r + 1])[0]), r
        assert np.array_equal(got[r], ops.attention_decode(q[r], keys[:pos[r] + 1], values[:pos[r] + 1])), r
    ref = ops.attention_prefill(q, keys, values, length - t)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the model
def _nvfp4(model: Qwen3_5Model) -> Qwen3_5Model:
    """Every projection with `in` a multiple of 16 replaced by its NVFP4 quantisation (the NVFP4Linear path)."""
    def swap(obj: Any) -> None:
        for name, value in vars(obj).items():
            if isinstance(value, DenseLinear) and value.shape[1] % 16 == 0:
                setattr(obj, name, NVFP4Linear(*quantize_nvfp4(np.ascontiguousarray(value.weight)), name=name))
    for lw in model.weights.layers:
        swap(lw.mixer)
        swap(lw.mlp)
    return model


@pytest.fixture(scope="module", params=["bf16", "fp8", "nvfp4", "moe", "next"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Qwen3_5Model:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "moe":
        return Qwen3_5MoeModel.load(write_moe_checkpoint(path, seed=3))
    if request.param == "next":  # fused GDN projections (RowSelect), a dense MLP layer among the MoE ones
        return Qwen3NextModel.load(write_moe_checkpoint(path, arch="qwen3_next", mlp_only_layers=(2,), seed=3))
    ckpt = write_checkpoint(path, init_std=0.1, seed=5, with_vision=False, num_shards=1,
                            fp8=request.param == "fp8")
    m = Qwen3_5Model.load(ckpt)
    if request.param == "fp8":
        assert isinstance(m.weights.layers[0].mlp.up, FP8BlockLinear)
    return _nvfp4(m) if request.param == "nvfp4" else m


def _ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def _pieces(cuts: list[int], n: int) -> list[tuple[int, int]]:
    ends = [c for c in cuts if 0 < c < n] + [n]
    return list(zip([0] + ends[:-1], ends))


def test_one_pass_pieces_and_decode_give_the_same_bits(model: Qwen3_5Model) -> None:
    """One pass; pieces cut at the chunk and key-block boundaries ±1; pieces of 7; decode token by token: the
    same state at the end, and every position's logits and hidden row equal (all_logits rows, piece ends, decode)."""
    ids = _ids(N)
    one, stepped, all_logits = row_checks.prefill_pieces_and_decode(
        model, ids, [_pieces(CUTS, N), _pieces(list(range(7, N, 7)), N)], N + 8)
    assert np.array_equal(model.prefill(model.new_state(N), ids), all_logits[-1])
    for state in (one, stepped):  # and they go on alike
        assert np.array_equal(model.decode(state, 5), model.decode(one if state is stepped else stepped, 5))


def test_a_state_of_another_size_gives_the_same_bits(model: Qwen3_5Model) -> None:
    """The state's max_len (the KV buffers' rows, where attention's last key block may be padded) changes nothing."""
    ids = _ids(KEY_BLOCK + 3, seed=1)
    tight, roomy = model.new_state(len(ids)), model.new_state(4 * KEY_BLOCK)
    assert np.array_equal(model.prefill(tight, ids), model.prefill(roomy, ids))
    row_checks.states_equal(tight, roomy, "max_len")


def test_mtp_head_rows_do_not_depend_on_how_they_are_grouped(tmp_path: Path) -> None:
    """The MTP head's own cache and output rows: one call of T rows == pieces == one row at a time."""
    m = Qwen3_5Model.load(write_checkpoint(tmp_path, init_std=0.1, seed=6, with_vision=False, num_shards=1))
    head = m.draft_heads()
    assert head is not None
    rng = np.random.default_rng(2)
    t = KEY_BLOCK + 5
    toks = rng.integers(0, 512, t).tolist()
    hidden = rng.standard_normal((t, m.hp.hidden_size)).astype(np.float32)
    runs = []
    for cuts in ([t], [1, 63, 64, 65, 255, 256, 257, t], list(range(1, t + 1))):
        state = head.new_state(t + 4)
        out, start = [], 0
        for end in cuts:
            out.append(head.forward(state, toks[start:end], hidden[start:end], start))
            start = end
        runs.append((np.concatenate(out), state))
    for out, state in runs[1:]:
        assert np.array_equal(out, runs[0][0])
        row_checks.states_equal(state, runs[0][1], "mtp")
