"""The MTP head (spec/qwen3_5.md §8) and the MTP drafter's token/hidden alignment."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tandem.backend import numpy_ops as ops
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.speculative.mtp_drafter import MTPDrafter
from tools.make_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Qwen3_5Model:
    return Qwen3_5Model.load(write_checkpoint(tmp_path_factory.mktemp("mtp"), init_std=0.1, seed=4))


def reference_step(model: Qwen3_5Model, token: int, hidden: np.ndarray) -> np.ndarray:
    """One MTP row at position 0 written from the spec: embedding FIRST, fc, one attention layer, mtp.norm."""
    head = model.draft_heads()
    w, eps = head.weights, model.hp.rms_norm_eps
    e = ops.rms_norm(model.weights.embed[[token]], w.norm_embedding, eps)
    h = ops.rms_norm(hidden[None], w.norm_hidden, eps)
    u = np.concatenate([e, h], axis=1) @ w.fc.weight.T
    lw = w.layer
    x = ops.rms_norm(u, lw.input_norm, eps)
    q, k, v, gate = model.attention_qkv(lw.mixer, x, np.array([0]), lambda lin, a: a @ lin.weight.T)
    a = ops.attention_decode(q[0], k, v)[None]  # position 0 sees only itself
    u = u + (a.reshape(1, -1) * ops.sigmoid(gate)) @ lw.mixer.o.weight.T
    y = ops.rms_norm(u, lw.post_norm, eps)
    u = u + (ops.silu(y @ lw.mlp.gate.weight.T) * (y @ lw.mlp.up.weight.T)) @ lw.mlp.down.weight.T
    return ops.rms_norm(u, w.norm, eps)[0]


def test_head_matches_the_spec_formula(model: Qwen3_5Model) -> None:
    head = model.draft_heads()
    assert head is not None
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal(model.hp.hidden_size).astype(np.float32)
    got = head.forward(head.new_state(4), [17], hidden[None], 0)[0]
    np.testing.assert_allclose(got, reference_step(model, 17, hidden), rtol=1e-4, atol=1e-5)


def test_batched_rows_equal_row_by_row(model: Qwen3_5Model) -> None:
    head = model.draft_heads()
    rng = np.random.default_rng(1)
    toks = rng.integers(0, model.hp.vocab_size, 9).tolist()
    hid = rng.standard_normal((9, model.hp.hidden_size)).astype(np.float32)
    batch = head.forward(head.new_state(16), toks, hid, 0)
    st = head.new_state(16)
    rows = np.concatenate([head.forward(st, [toks[i]], hid[i:i + 1], i) for i in range(9)])
    np.testing.assert_allclose(batch, rows, rtol=1e-4, atol=1e-5)


def test_drafter_aligns_tokens_with_hidden_states(model: Qwen3_5Model) -> None:
    """Row t consumes (token_{t+1}, h_t): after reset + extend, the head's committed rows equal one batch."""
    head = model.draft_heads()
    rng = np.random.default_rng(2)
    state = model.new_state(64)
    ids = rng.integers(0, model.hp.vocab_size, 12).tolist()
    hidden: list[np.ndarray] = []
    model.prefill(state, ids, hidden_out=hidden)
    more = rng.integers(0, model.hp.vocab_size, 3).tolist()
    for t in more:
        model.decode(state, t, hidden_out=hidden)
    h = np.concatenate(hidden)
    d = MTPDrafter(head, steps=3)
    d.reset(ids, h[:12], 64)
    d.extend(more, h[12:])
    frag = d.propose(5, 8, 3)
    assert 3 <= len(frag) <= 8
    allids = ids + more
    ref = head.new_state(64)
    out = head.forward(ref, allids[1:] + [5], h, 0)  # rows 0..14, the last with the pending root
    assert d.filled == 14
    np.testing.assert_allclose(d.state.buffers["k"][:15], ref.buffers["k"][:15], rtol=1e-4, atol=1e-5)
    assert frag.token_ids[0] == int(np.argmax(head.logits(out[-1:])[0]))


class _CappedHead:
    """A head whose top_probs returns at most 2 ids, the second past the vocabulary (probability 0)."""

    max_top_k = 2
    chains = False

    def __init__(self) -> None:
        self.asked: list[int] = []

    def new_state(self, max_len: int) -> SimpleNamespace:
        return SimpleNamespace(max_len=max_len, length=0)

    def forward(self, state: SimpleNamespace, ids: list[int], hidden: np.ndarray, start: int) -> np.ndarray:
        state.length = start + len(ids)
        return np.zeros((len(ids), 4), dtype=np.float32)

    def top_probs(self, hidden: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        self.asked.append(k)
        return np.array([5, 0x7FFFFFFF][:k]), np.array([1.0, 0.0][:k])


def test_drafter_caps_branching_at_the_head_and_skips_missing_ids() -> None:
    head = _CappedHead()
    d = MTPDrafter(head, steps=2, branch_ratio=0.0, max_branch=6)
    assert d.max_branch == 2
    d.reset([1, 2, 3], np.zeros((3, 4), dtype=np.float32), 8)
    frag = d.propose(9, 8, 2)
    assert frag.token_ids == [5, 5] and frag.parents == [-1, 0] and head.asked == [2, 2]


class _ChainHead:
    """The host head with a ``chain`` as the device head has one: the same rows, the best id fed back, all rows'
    top ids returned at once (so the drafter's chain path can be checked against its row-by-row loop)."""

    def __init__(self, head: object) -> None:
        self.head = head
        self.chains: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.head, name)

    def chain(self, state: object, root: int, hidden: np.ndarray, start: int, steps: int,
              k: int) -> tuple[np.ndarray, np.ndarray]:
        self.chains.append(steps)
        ids, probs, token, h = [], [], root, hidden
        for s in range(steps):
            h = self.head.forward(state, [token], h, start + s)  # type: ignore[attr-defined]
            top, p = self.head.top_probs(h, k)  # type: ignore[attr-defined]
            ids.append(top)
            probs.append(p)
            token = int(top[0])
        return np.stack(ids), np.stack(probs)


@pytest.mark.parametrize("max_nodes,max_depth,room", [(16, 4, 64), (2, 4, 64), (5, 2, 64), (16, 4, 1), (1, 1, 64)])
def test_the_chain_path_drafts_the_loops_tree(model: Qwen3_5Model, max_nodes: int, max_depth: int,
                                               room: int) -> None:
    """A head with ``chain`` (the device head runs the chain with one host read) gives the drafter the tree its
    row-by-row loop builds, for node, depth and cache limits, and runs no more rows than those limits allow."""
    head = model.draft_heads()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, model.hp.vocab_size, 10).tolist()
    hidden = rng.standard_normal((10, model.hp.hidden_size)).astype(np.float32)
    frags, lengths = [], []
    wrapped = _ChainHead(head)
    for use_chain in (False, True):
        d = MTPDrafter(wrapped, steps=4, branch_ratio=0.0, max_branch=3)
        d.device_chain = use_chain
        d.reset(ids, hidden, 0)
        d.state = head.new_state(10 + room)  # room rows past the committed ones
        frag = d.propose(7, max_nodes, max_depth)
        frags.append((frag.token_ids, frag.parents, frag.confidences))
        lengths.append(d.state.length)
    assert frags[0] == frags[1] and lengths[0] == lengths[1] == 9
    assert len(frags[0][0]) == min(max_nodes, 3 * min(4, max_depth, room + 1))  # 9 rows committed of 10 + room
    assert wrapped.chains == [min(4, max_depth, max_nodes, room + 1)]
