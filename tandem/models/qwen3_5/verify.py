"""Tree verify and commit for the Qwen3.5 hybrid on the NumPy reference (DESIGN.md, "Branch, undo, restore").

``verify_tree`` runs every node of a draft tree (tandem/speculative/tree.py: node 0 is the pending root token at
position P = state.length, ``parent_ids[i] < i``, node i at position P + depth_i) through the model and returns
logits [N, V] where row i has exactly the bits a plain ``decode`` of node i would produce after decoding its
ancestors one by one:
- matrix rows: every projection goes through ``Linear.matmul`` (one GEMV per row, row-invariant);
- row-wise ops (norms, gates, SiLU, RoPE, the MLP) act on each row alone, elementwise or reducing over the
  last axis, so a row's bits do not depend on N;
- GDN conv: node i's window is the last K-1 pre-conv rows of its path (entry tail, then its ancestors' rows)
  followed by its own row, convolved with the same multiply-add order as ``ops.causal_conv``;
- GDN recurrence: ``ops.gdn_step`` per node on a copy of its parent's state (the entry state for the root);
- attention: ``ops.attention_rows`` per node over rows [0, P + depth] of the layer's own cache buffer, where
  rows P.. hold the node's ancestors then itself (rows ≥ P are scratch until commit), exactly the slice a decode
  at that position reads.
``commit`` keeps the accepted path (undo = drop the rest): K/V rows move to positions P.., the conv tail takes the
path's last K-1 pre-conv rows and the recurrent state is rebuilt by replaying the path's (k, v, g, beta) with
``ops.gdn_step`` onto the entry state (or, ``replay=False``, copied from the per-node state kept by verify; both
give decode's bits, tests/test_spec_verify.py).

Memory: ``TreeScratch`` holds every per-round buffer for ``max_nodes`` and is allocated once per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.backend import numpy_ops as ops
from tandem.backend.kv_rows import read_rows, round_rows, write_rows
from tandem.backend.tree_ops import tree_windows
from tandem.formats import Linear
from tandem.models.qwen3_5.hparams import FULL, HParams
from tandem.models.qwen3_5.host import HostModel
from tandem.models.qwen3_5.mrope import multimodal_rows
from tandem.models.qwen3_5.state_layout import check_tree
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights
from tandem.models.state import ModelState

F32 = np.float32


def decode_matmul(lin: Linear, x: np.ndarray) -> np.ndarray:
    """The decode path's matmul: one GEMV per row (``Linear.matmul``), row-invariant."""
    return lin.matmul(x)


class TreeScratch:
    """Per-sequence buffers of verify and commit, for trees of at most ``max_nodes`` nodes.

    Layout (per layer, float32): GDN ``pre`` [N, conv_dim] pre-conv rows, ``k`` [N, Hv, dk], ``v`` [N, Hv, dv],
    ``g``/``beta`` [N, Hv], ``ssm`` [N, Hv, dk, dv] per-node recurrent states; attention ``k``/``v`` [N, Hkv, D]
    rows (the values the state's KV storage holds: rounded to bf16 for a bf16 cache). ``hidden`` [N, E]:
    post-final-norm hidden states of the last verify (the MTP drafter's input).
    """

    def __init__(self, hp: HParams, max_nodes: int) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        n = self.max_nodes = max_nodes
        hv, dk, dv = hp.linear_num_value_heads, hp.linear_key_head_dim, hp.linear_value_head_dim
        self.buffers: dict[str, np.ndarray] = {}
        for i, kind in enumerate(hp.layer_types):
            if kind == FULL:
                shape = (n, hp.num_key_value_heads, hp.head_dim)
                self.buffers[f"{i}.k"] = np.zeros(shape, F32)
                self.buffers[f"{i}.v"] = np.zeros(shape, F32)
            else:
                self.buffers[f"{i}.pre"] = np.zeros((n, hp.conv_dim), F32)
                self.buffers[f"{i}.k"] = np.zeros((n, hv, dk), F32)
                self.buffers[f"{i}.v"] = np.zeros((n, hv, dv), F32)
                self.buffers[f"{i}.g"] = np.zeros((n, hv), F32)
                self.buffers[f"{i}.beta"] = np.zeros((n, hv), F32)
                self.buffers[f"{i}.ssm"] = np.zeros((n, hv, dk, dv), F32)
        self.hidden = np.zeros((n, hp.hidden_size), F32)
        self.parent_ids: list[int] = []
        self.depths: list[int] = []
        self.start = 0  # P, the root's position, of the last verify

    def nbytes(self) -> int:
        """Bytes held by the scratch buffers."""
        return sum(int(b.nbytes) for b in self.buffers.values()) + int(self.hidden.nbytes)


def verify_tree(model: HostModel, state: ModelState, scratch: TreeScratch, token_ids: Sequence[int],
                parent_ids: Sequence[int]) -> np.ndarray:
    """Run a draft tree after the committed tokens; bind as the adapter verb ``verify_tree``.

    Args:
        state: the sequence; its committed length P is the root's position. Only rows ≥ P of the attention
            caches are written (scratch); sections are read, not written.
        scratch: per-sequence buffers (``model.new_tree_scratch``).
        token_ids: [N] node tokens, node 0 the root. parent_ids: [N], -1 then parent_ids[i] < i.
    Returns: logits [N, V] float32; row i predicts position P + depth_i + 1 (bits of a plain decode).
    Raises: ValueError on a malformed tree, a bad token id, too many nodes, or a tree past the state's end.
    """
    depths = check_tree(model.hp, state, scratch.max_nodes, token_ids, parent_ids)
    scratch.parent_ids, scratch.depths, scratch.start = list(parent_ids), depths, state.length
    hp, mm, eps = model.hp, decode_matmul, model.hp.rms_norm_eps
    x = model.weights.embed[np.asarray(token_ids, dtype=np.int64)].astype(F32)
    for i, lw in enumerate(model.weights.layers):
        h = ops.rms_norm(x, lw.input_norm, eps)
        if lw.kind == FULL:
            assert isinstance(lw.mixer, AttnWeights)
            x = x + _attention_tree(model, lw.mixer, h, state, scratch, i)
        else:
            assert isinstance(lw.mixer, GDNWeights)
            x = x + _gdn_tree(model, lw.mixer, h, state, scratch, i)
        x = x + model._mlp(lw, ops.rms_norm(x, lw.post_norm, hp.rms_norm_eps), mm)
    normed = ops.rms_norm(x, model.weights.norm, eps)
    scratch.hidden[:len(token_ids)] = normed
    return mm(model.head, normed)


def _gdn_tree(model: HostModel, w: GDNWeights, h: np.ndarray, state: ModelState, scratch: TreeScratch,
              i: int) -> np.ndarray:
    """The GDN layer over tree nodes; mirrors ``Qwen3_5Model.gdn_inputs`` (T = 1 per node) and ``_gdn``."""
    hp, mm, b = model.hp, decode_matmul, scratch.buffers
    n = h.shape[0]
    pre = b[f"{i}.pre"]
    pre[:n] = mm(w.in_qkv, h)
    win = tree_windows(state.buffers[f"layers.{i}.conv"], pre, scratch.parent_ids)
    acc = win[:, 0] * w.conv[:, 0]  # the multiply-add order of ops.causal_conv
    for j in range(1, w.conv.shape[1]):
        acc = acc + win[:, j] * w.conv[:, j]
    u = ops.silu(acc.astype(F32, copy=False))
    kd, r = hp.key_dim, hp.linear_num_value_heads // hp.linear_num_key_heads
    q = ops.l2norm(u[:, :kd].reshape(n, hp.linear_num_key_heads, hp.linear_key_head_dim))
    q = (q * F32(1.0 / np.sqrt(hp.linear_key_head_dim))).astype(F32)
    k = ops.l2norm(u[:, kd:2 * kd].reshape(n, hp.linear_num_key_heads, hp.linear_key_head_dim))
    q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    v = u[:, 2 * kd:].reshape(n, hp.linear_num_value_heads, hp.linear_value_head_dim)
    g, beta = ops.gdn_gates(mm(w.in_a, h), mm(w.in_b, h), w.a_log, w.dt_bias)
    z = mm(w.in_z, h).reshape(n, hp.linear_num_value_heads, hp.linear_value_head_dim)
    b[f"{i}.k"][:n], b[f"{i}.v"][:n], b[f"{i}.g"][:n], b[f"{i}.beta"][:n] = k, v, g, beta
    entry, states = state.buffers[f"layers.{i}.ssm"], b[f"{i}.ssm"]
    o = np.empty((n, hp.linear_num_value_heads, hp.linear_value_head_dim), F32)
    for node in range(n):
        parent = scratch.parent_ids[node]
        np.copyto(states[node], entry if parent < 0 else states[parent])
        o[node] = ops.gdn_step(states[node], q[node], k[node], v[node], g[node], beta[node])
    return model.gdn_output(w, o, z, mm)


def _attention_tree(model: HostModel, w: AttnWeights, h: np.ndarray, state: ModelState,
                    scratch: TreeScratch, i: int) -> np.ndarray:
    """The attention layer over tree nodes: node i reads cache rows [0, P + depth_i] holding its path."""
    mm, p, n = decode_matmul, scratch.start, h.shape[0]
    rows = multimodal_rows(state)  # past an image prompt, every position is index + delta
    delta = rows.delta if rows is not None else 0
    q, k, v, gate = model.attention_qkv(w, h, np.asarray([p + d + delta for d in scratch.depths]), mm)
    kn, vn = scratch.buffers[f"{i}.k"], scratch.buffers[f"{i}.v"]
    kc, vc = state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"]
    kn[:n], vn[:n] = round_rows(k, kc.dtype), round_rows(v, vc.dtype)  # the values the cache will hold
    owner = [-1] * (max(scratch.depths) + 1)  # which node's rows sit at cache row P + d
    a = np.empty(q.shape, F32)
    for node in range(n):
        d, m = scratch.depths[node], node
        while m >= 0:  # the whole path: a sibling branch may have taken any ancestor's row
            dm = scratch.depths[m]
            if owner[dm] != m:
                write_rows(kc, p + dm, kn[m:m + 1])
                write_rows(vc, p + dm, vn[m:m + 1])
                owner[dm] = m
            m = scratch.parent_ids[m]
        a[node] = ops.attention_rows(q[node:node + 1], read_rows(kc, p + d + 1), read_rows(vc, p + d + 1),
                                     np.asarray([p + d]))[0]
    return model.attention_output(w, a, gate, mm)


def commit(model: HostModel, state: ModelState, scratch: TreeScratch, path: Sequence[int],
           replay: bool = True) -> None:
    """Append the accepted ``path`` (node ids from the root, each the parent of the next) of the last verify to
    the state; bind as the adapter verb ``commit``.

    After it the state equals, bit for bit, the state after decoding the path's tokens one by one.
    Raises: ValueError if the path does not start at the root, is not a parent chain of the last verified tree,
    or the state moved since verify.
    """
    if state.length != scratch.start:
        raise ValueError(f"state length {state.length} differs from the verified tree's start {scratch.start}")
    if not path or path[0] != 0 or any(scratch.parent_ids[path[j]] != path[j - 1] for j in range(1, len(path))):
        raise ValueError(f"path {list(path)} is not a root-to-node chain of the verified tree")
    p, b, num = scratch.start, scratch.buffers, len(path)
    rows = np.asarray(path, dtype=np.int64)
    for i, kind in enumerate(model.hp.layer_types):
        if kind == FULL:
            write_rows(state.buffers[f"layers.{i}.k"], p, b[f"{i}.k"][rows])  # exact: rounded at verify
            write_rows(state.buffers[f"layers.{i}.v"], p, b[f"{i}.v"][rows])
            continue
        tail = state.buffers[f"layers.{i}.conv"]
        km1 = tail.shape[0]
        history = np.concatenate([tail, b[f"{i}.pre"][rows]])
        tail[...] = history[history.shape[0] - km1:]
        ssm = state.buffers[f"layers.{i}.ssm"]
        if not replay:
            np.copyto(ssm, b[f"{i}.ssm"][path[-1]])
            continue
        k, v, g, beta = b[f"{i}.k"], b[f"{i}.v"], b[f"{i}.g"], b[f"{i}.beta"]
        for node in path:  # the decode step's update; q only feeds the output, which is not needed here
            ops.gdn_step(ssm, k[node], k[node], v[node], g[node], beta[node])
    state.length += num
