"""The row-invariance checks, written once: tests/test_prefill_rows.py runs them on the host's BLAS kernels (with
more shapes and its own extras), tests/test_row_invariance_cores.py in children under forced OpenBLAS core types.
Each raises AssertionError naming the first difference. Sources: tandem/formats/linear.py,
tandem/backend/numpy_ops.py, tandem/models/qwen3_5/model.py and verify.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend import numpy_ops as ops


def misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` one float32 past the start of a fresh buffer (another alignment than ``a``'s)."""
    out = np.empty(a.size + 1, np.float32)[1:].reshape(a.shape)
    out[...] = a
    return out


def linear_rows(lin: Any, x: np.ndarray, cuts: Sequence[tuple[int, int]]) -> np.ndarray:
    """Rows of ``lin.matmul`` over x [T, in]: one call == one-row calls == each cut [a, b) == a strided x == x at
    another alignment. Returns the one-row results [T, out]."""
    shape = lin.shape
    single = np.stack([lin.matmul(x[i:i + 1])[0] for i in range(x.shape[0])])
    assert np.array_equal(lin.matmul(x), single), f"Linear {shape}: {x.shape[0]} rows"
    for a, b in cuts:
        assert np.array_equal(lin.matmul(x[a:b]), single[a:b]), f"Linear {shape}: rows [{a}, {b})"
    assert np.array_equal(lin.matmul(x[::2]), single[::2]), f"Linear {shape}: strided rows"
    assert np.array_equal(lin.matmul(misaligned(x)), single), f"Linear {shape}: misaligned rows"
    return single


def gdn_inputs(rng: np.random.Generator, t: int, hv: int, dk: int, dv: int) -> tuple[np.ndarray, ...]:
    """(q, k [T, Hv, dk] normalised, v [T, Hv, dv], g, beta [T, Hv], a start state [Hv, dk, dv]), float32."""
    q = ops.l2norm(rng.standard_normal((t, hv, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    k = ops.l2norm(rng.standard_normal((t, hv, dk)).astype(np.float32))
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g = (-rng.uniform(0.0, 3.0, (t, hv))).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, hv)).astype(np.float32)
    return q, k, v, g, beta, rng.standard_normal((hv, dk, dv)).astype(np.float32)


def gdn_rows_are_steps(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``gdn_rows`` over T tokens == ``gdn_step`` token by token on a copy of the state at another alignment
    (outputs and state). Returns (outputs [T, Hv, dv], the state after them)."""
    rows, steps = start.copy(), misaligned(start)
    o_rows = ops.gdn_rows(rows, q, k, v, g, beta)
    o_steps = np.stack([ops.gdn_step(steps, q[i].copy(), k[i].copy(), v[i], g[i], beta[i])
                        for i in range(q.shape[0])])
    assert np.array_equal(o_rows, o_steps) and np.array_equal(rows, steps), "gdn_rows != gdn_step"
    return o_rows, rows


def attention_rows_are_one_row_calls(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                                     pos: np.ndarray) -> np.ndarray:
    """``attention_rows`` rows of one call == one-row calls with the query at another alignment. Returns the rows."""
    got = ops.attention_rows(q, keys, values, pos)
    for r in range(q.shape[0]):
        one = ops.attention_rows(misaligned(q[r:r + 1]), keys, values, pos[r:r + 1])[0]
        assert np.array_equal(got[r], one), f"attention_rows row {r}"
    return got


def states_equal(a: Any, b: Any, label: str) -> None:
    """Two states hold the same bits: every section, and every view's rows up to the length."""
    assert a.length == b.length, label
    for spec in a.specs:
        n = a.length if spec.kind == "view" else None
        assert np.array_equal(a.buffers[spec.name][:n], b.buffers[spec.name][:n]), f"{label}: {spec.name}"


def prefill_pieces_and_decode(model: Any, ids: list[int], piece_sets: Sequence[Sequence[tuple[int, int]]],
                              max_len: int) -> tuple[Any, Any, np.ndarray]:
    """A prefill in one pass == in each set of pieces [a, b) == decode token by token: each piece's logits == the
    one pass's row at its end, decode's logits == every row, and at the end the same state and the same hidden
    rows. Returns (the one pass's state, the decoded state, the one pass's logits [T, V])."""
    one = model.new_state(max_len)
    hidden_one: list[np.ndarray] = []
    all_logits = model.prefill(one, ids, all_logits=True, hidden_out=hidden_one)
    for k, pieces in enumerate(piece_sets):
        state = model.new_state(max_len)
        hidden: list[np.ndarray] = []
        for a, b in pieces:
            logits = model.prefill(state, ids[a:b], hidden_out=hidden)
            assert np.array_equal(logits, all_logits[b - 1]), f"pieces {k}: prefill piece [{a}, {b})"
        states_equal(one, state, f"pieces {k}")
        assert np.array_equal(np.concatenate(hidden), np.concatenate(hidden_one)), f"pieces {k}: hidden rows"
    stepped = model.new_state(max_len)
    hidden_dec: list[np.ndarray] = []
    assert np.array_equal(model.prefill(stepped, ids[:1], hidden_out=hidden_dec), all_logits[0]), "one token"
    for p in range(1, len(ids)):
        assert np.array_equal(model.decode(stepped, ids[p], hidden_out=hidden_dec), all_logits[p]), \
            f"decode at {p} != prefill row"
    states_equal(one, stepped, "decode")
    assert np.array_equal(np.concatenate(hidden_dec), np.concatenate(hidden_one)), "decode: hidden rows"
    return one, stepped, all_logits


def verify_rows_are_decodes(model: Any, state: Any, tokens: list[int], parents: list[int]) -> None:
    """A verified tree's rows (``verify_tree`` from ``state``) == plain decodes of each node's path from a copy of
    ``state``."""
    entry = model.new_state(state.max_len)
    entry.copy_from(state)
    verified = model.verify_tree(state, model.new_tree_scratch(len(parents)), tokens, parents)
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        plain = model.new_state(state.max_len)
        plain.copy_from(entry)
        for n in reversed(path):
            want = model.decode(plain, tokens[n])
        assert np.array_equal(verified[node], want), f"verify node {node} != decode of its path"
