"""Prefill vs decode on tiny random checkpoints: argmax agreement, bitwise chunk boundaries, restore, flat memory.

Sources: tandem/models/qwen3_5/model.py (prefill in pieces ending at absolute multiples of GDN_CHUNK, every token
with decode's arithmetic: tests/test_prefill_rows.py checks the bits), DESIGN.md "restore" and "State: sections
and views".
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tandem.backend.numpy_ops import GDN_CHUNK, KEY_BLOCK
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.state import ModelState
from tools.make_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Qwen3_5Model:
    """init_std 0.1 (as the parity tests) so hidden states carry signal and top-1 margins are not all ~0."""
    path = write_checkpoint(tmp_path_factory.mktemp("pd"), init_std=0.1, seed=4, with_vision=False,
                            with_mtp=False, num_shards=1)
    return Qwen3_5Model.load(path)


def _ids(seed: int, n: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _assert_states_equal(a: ModelState, b: ModelState) -> None:
    assert a.length == b.length
    for name in a.buffers:
        assert np.array_equal(a.buffers[name], b.buffers[name]), name


def test_decode_after_prefill_matches_one_prefill_at_argmax(model: Qwen3_5Model) -> None:
    checked = flips = 0
    for seed in range(8):
        full = _ids(seed, int(np.random.default_rng(100 + seed).integers(20, 150)))
        ref = model.prefill(model.new_state(len(full)), full, all_logits=True)  # [T, V]
        split = int(np.random.default_rng(200 + seed).integers(1, len(full) - 12))
        state = model.new_state(len(full))
        logits = model.prefill(state, full[:split])
        np.testing.assert_allclose(logits, ref[split - 1], rtol=0, atol=1e-4 * np.abs(ref).max())
        for pos in range(split, len(full)):
            top2 = np.sort(ref[pos - 1])[-2:]
            if top2[1] - top2[0] > 1e-3:  # a choice that is not a tie within fp32 rounding of the two forms
                assert int(np.argmax(logits)) == int(np.argmax(ref[pos - 1])), (seed, pos)
                checked += 1
            else:
                flips += 1
            logits = model.decode(state, full[pos])
            assert np.abs(logits - ref[pos]).max() < 1e-4 * np.abs(ref[pos]).max(), (seed, pos)
    assert checked > 300 and flips <= checked // 50


@pytest.mark.parametrize("n,split", [(150, 64), (150, 128), (65, 64), (200, 192), (256, 128)])
def test_split_at_chunk_boundary_is_bitwise(model: Qwen3_5Model, n: int, split: int) -> None:
    """A prompt in one piece or in two cut at a multiple of GDN_CHUNK gives the same state and logits, bit for
    bit (n=65: the second piece is a single token, prefilled as a one-token chunk in both runs)."""
    assert split % GDN_CHUNK == 0
    ids = _ids(n + split, n)
    one = model.new_state(n + 3)
    l_one = model.prefill(one, ids)
    two = model.new_state(n + 3)
    model.prefill(two, ids[:split])
    l_two = model.prefill(two, ids[split:])
    assert np.array_equal(l_one, l_two)
    _assert_states_equal(one, two)
    # decode continues bitwise too
    for t in (5, 6, 7):
        assert np.array_equal(model.decode(one, t), model.decode(two, t))
    _assert_states_equal(one, two)


def test_all_logits_rows_are_split_invariant(model: Qwen3_5Model) -> None:
    ids = _ids(9, 2 * GDN_CHUNK + 10)
    whole = model.prefill(model.new_state(len(ids)), ids, all_logits=True)
    state = model.new_state(len(ids))
    parts = [model.prefill(state, ids[a:b], all_logits=True)
             for a, b in ((0, GDN_CHUNK), (GDN_CHUNK, 2 * GDN_CHUNK), (2 * GDN_CHUNK, len(ids)))]
    assert np.array_equal(whole, np.concatenate(parts))


@pytest.mark.parametrize("boundary", [GDN_CHUNK, 2 * GDN_CHUNK])
def test_restore_at_chunk_boundary_continues_bitwise(model: Qwen3_5Model, boundary: int) -> None:
    ids = _ids(boundary, boundary + 77)
    fresh = model.new_state(len(ids) + 8)
    l_fresh = model.prefill(fresh, ids)
    # a cache snapshot taken at the boundary
    live = model.new_state(len(ids) + 8)
    model.prefill(live, ids[:boundary])
    snap = model.new_state(boundary)
    snap.copy_from(live)
    restored = model.new_state(len(ids) + 8)
    restored.copy_from(snap)
    l_restored = model.prefill(restored, ids[boundary:])
    assert np.array_equal(l_fresh, l_restored)
    _assert_states_equal(fresh, restored)
    for t in (1, 2, 3, 4):
        assert np.array_equal(model.decode(fresh, t), model.decode(restored, t))
    _assert_states_equal(fresh, restored)


def test_cut_inside_a_chunk_still_deterministic(model: Qwen3_5Model) -> None:
    """Same pieces give the same bits (pieces inside a chunk are a different, but repeatable, schedule)."""
    ids = _ids(3, 90)
    runs = []
    for _ in range(2):
        s = model.new_state(90)
        model.prefill(s, ids[:50])
        runs.append((model.prefill(s, ids[50:]), s))
    assert np.array_equal(runs[0][0], runs[1][0])
    _assert_states_equal(runs[0][1], runs[1][1])


def test_decode_memory_is_flat(model: Qwen3_5Model) -> None:
    """1,000 decode steps after the preallocated state: traced memory (current and peak) does not grow (beyond one
    padded key block's transient) and no state buffer is reallocated."""
    prompt = _ids(77, 20)
    state = model.new_state(len(prompt) + 1000)
    logits = model.prefill(state, prompt)
    buffers = {n: (id(b), b.ctypes.data) for n, b in state.buffers.items()}
    tok = int(np.argmax(logits))
    cur_a = np.zeros(900, np.int64)  # preallocated: a growing Python list would itself show as growth
    peak_a = np.zeros(900, np.int64)
    tracemalloc.start()
    try:
        for step in range(1000):
            if step >= 100:
                tracemalloc.reset_peak()
            logits = model.decode(state, tok)
            tok = int(np.argmax(logits))
            if step >= 100:
                cur_a[step - 100], peak_a[step - 100] = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    hp = model.hp  # near the state's end attention_rows pads its last key block in a zeroed K and V copy
    slack = 64 * 1024 + 2 * KEY_BLOCK * hp.num_key_value_heads * hp.head_dim * 4
    print(f"\ntraced current {cur_a.min()}..{cur_a.max()} B, peak {peak_a.min()}..{peak_a.max()} B")
    assert cur_a.max() - cur_a[0] < slack, f"current grew by {cur_a.max() - cur_a[0]} bytes"
    assert peak_a.max() - peak_a[:10].min() < slack, f"peak grew by {peak_a.max() - peak_a[:10].min()} bytes"
    # no trend: the last hundred steps sit where the first hundred did (attention scores grow by S floats only)
    assert abs(np.median(cur_a[-100:]) - np.median(cur_a[:100])) < 8 * 1024
    slope = np.polyfit(np.arange(cur_a.size), cur_a, 1)[0]
    assert slope < 8.0, f"current memory trend {slope:.1f} bytes/step"
    assert state.length == len(prompt) + 1000
    assert {n: (id(b), b.ctypes.data) for n, b in state.buffers.items()} == buffers
