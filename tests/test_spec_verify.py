"""Tree verify and commit give decode's bits (DESIGN.md, "Branch, undo, restore"; issue 5 "Row invariance").

- every verified node's logits equal, bit for bit, a plain decode of its path (chains, bushes, mixed trees);
- commit (replay and copy) leaves the state bit-identical to decoding the accepted path token by token;
- the reference ops that verify uses are row-invariant: N rows through them give each row a one-row decode's bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_helpers import assert_states_equal
from tandem.backend import numpy_ops as ops
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.state import ModelState
from tools.make_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Qwen3_5Model:
    return Qwen3_5Model.load(write_checkpoint(tmp_path_factory.mktemp("verify"), init_std=0.1, seed=5))


def random_tree(rng: np.random.Generator, n: int, shape: str) -> list[int]:
    """parent_ids of an n-node tree: a chain, a bush (all children of the root) or mixed."""
    if shape == "chain":
        return [-1] + list(range(n - 1))
    if shape == "bush":
        return [-1] + [0] * (n - 1)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def path_of(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def clone(model: Qwen3_5Model, state: ModelState) -> ModelState:
    other = model.new_state(state.max_len)
    other.copy_from(state)
    return other


def prefilled(model: Qwen3_5Model, rng: np.random.Generator, max_len: int = 200) -> tuple[ModelState, int]:
    state = model.new_state(max_len)
    prompt = rng.integers(0, model.hp.vocab_size, int(rng.integers(1, 90))).tolist()
    model.prefill(state, prompt)
    for _ in range(int(rng.integers(0, 3))):  # some decoded history too
        model.decode(state, int(rng.integers(0, model.hp.vocab_size)))
    return state, int(rng.integers(0, model.hp.vocab_size))


@pytest.mark.parametrize("shape", ["chain", "bush", "mixed"])
def test_verify_rows_equal_decode(model: Qwen3_5Model, shape: str) -> None:
    rng = np.random.default_rng({"chain": 1, "bush": 2, "mixed": 3}[shape])
    scratch = model.new_tree_scratch(32)
    for _ in range(6):
        state, root = prefilled(model, rng)
        n = int(rng.integers(1, 33))
        parents = random_tree(rng, n, shape)
        tokens = [root] + rng.integers(0, model.hp.vocab_size, n - 1).tolist()
        before = clone(model, state)
        logits = model.verify_tree(state, scratch, tokens, parents)
        assert logits.shape == (n, model.hp.vocab_size)
        assert_states_equal(state, before)  # verify writes no committed buffer
        for node in range(n):
            ref_state = clone(model, before)
            hidden: list[np.ndarray] = []
            for t in [tokens[m] for m in path_of(parents, node)]:
                ref = model.decode(ref_state, t, hidden_out=hidden)
            assert np.array_equal(logits[node], ref), f"{shape}: node {node} logits differ from decode"
            assert np.array_equal(scratch.hidden[node], hidden[-1][0])


@pytest.mark.parametrize("replay", [True, False])
def test_commit_equals_decoding_the_path(model: Qwen3_5Model, replay: bool) -> None:
    rng = np.random.default_rng(10 + replay)
    scratch = model.new_tree_scratch(24)
    for _ in range(8):
        state, root = prefilled(model, rng)
        n = int(rng.integers(1, 25))
        parents = random_tree(rng, n, "mixed")
        tokens = [root] + rng.integers(0, model.hp.vocab_size, n - 1).tolist()
        ref_state = clone(model, state)
        model.verify_tree(state, scratch, tokens, parents)
        path = path_of(parents, int(rng.integers(0, n)))
        model.commit(state, scratch, path, replay=replay)
        for node in path:
            model.decode(ref_state, tokens[node])
        assert_states_equal(state, ref_state)
        # and the committed state keeps decoding with decode's bits
        t = int(rng.integers(0, model.hp.vocab_size))
        assert np.array_equal(model.decode(state, t), model.decode(ref_state, t))


def test_repeated_rounds_stay_exact(model: Qwen3_5Model) -> None:
    """Many verify+commit rounds in a row equal plain decoding of the committed tokens."""
    rng = np.random.default_rng(7)
    scratch = model.new_tree_scratch(8)
    state, root = prefilled(model, rng, max_len=400)
    ref_state = clone(model, state)
    for _ in range(30):
        n = int(rng.integers(1, 9))
        parents = random_tree(rng, n, "mixed")
        tokens = [root] + rng.integers(0, model.hp.vocab_size, n - 1).tolist()
        logits = model.verify_tree(state, scratch, tokens, parents)
        path = path_of(parents, int(rng.integers(0, n)))
        model.commit(state, scratch, path)
        for node in path:
            ref = model.decode(ref_state, tokens[node])
        assert np.array_equal(logits[path[-1]], ref)
        root = int(np.argmax(ref))
    assert_states_equal(state, ref_state)


def test_verify_rejects_bad_trees(model: Qwen3_5Model) -> None:
    state = model.new_state(8)
    model.prefill(state, [1, 2, 3])
    scratch = model.new_tree_scratch(4)
    with pytest.raises(ValueError):
        model.verify_tree(state, scratch, [1, 2], [-1, 1])
    with pytest.raises(ValueError):
        model.verify_tree(state, scratch, [1] * 5, [-1, 0, 0, 0, 0])
    with pytest.raises(ValueError):  # past the state's end: positions 3..8 in an 8-row state
        model.verify_tree(state, model.new_tree_scratch(8), [1] * 6, [-1, 0, 1, 2, 3, 4])
    model.verify_tree(state, scratch, [1, 2], [-1, 0])
    with pytest.raises(ValueError):
        model.commit(state, scratch, [1])


def test_reference_ops_are_row_invariant(model: Qwen3_5Model) -> None:
    """Each op verify batches over N rows gives every row the bits of a one-row call (a plain GEMM would not)."""
    rng = np.random.default_rng(3)
    e, hp = model.hp.hidden_size, model.hp
    for n in (2, 7, 32):
        x = rng.standard_normal((n, e)).astype(np.float32)
        lin = model.weights.layers[0].mlp.up
        rows = lin.matmul(x)
        for i in range(n):
            one = x[i:i + 1]
            assert np.array_equal(rows[i], lin.matmul(one)[0])
            assert np.array_equal(ops.rms_norm(x, model.weights.norm, 1e-6)[i],
                                  ops.rms_norm(one, model.weights.norm, 1e-6)[0])
            assert np.array_equal(ops.silu(x)[i], ops.silu(one)[0])
        heads = rng.standard_normal((n, hp.linear_num_key_heads, hp.linear_key_head_dim)).astype(np.float32)
        cos, sin = ops.rope_tables(np.arange(100, 100 + n), hp.rotary_dim, hp.rope_theta)
        for i in range(n):
            assert np.array_equal(ops.l2norm(heads)[i], ops.l2norm(heads[i:i + 1])[0])
            c1, s1 = ops.rope_tables(np.asarray([100 + i]), hp.rotary_dim, hp.rope_theta)
            assert np.array_equal(cos[i], c1[0]) and np.array_equal(sin[i], s1[0])


def test_scratch_memory_is_fixed(model: Qwen3_5Model, tmp_path: Path) -> None:
    scratch = model.new_tree_scratch(16)
    before = scratch.nbytes()
    state, root = prefilled(model, np.random.default_rng(0))
    for _ in range(5):
        model.verify_tree(state, scratch, [root, 1, 2], [-1, 0, 1])
        model.commit(state, scratch, [0])
    assert scratch.nbytes() == before
