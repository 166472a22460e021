"""The batched decode's host side and NumPy twins (tandem/backend/cuda/decode_slots.py), on the CPU: the per-pass
slot table (positions, rotary positions, rows, each slot's first chunk of partials), and the twins, the loop over
slots of attention_decode.reference_step / gdn_seq.reference_prefill, whose slot rows do not depend on the other
slots (their number, lengths, order or contents). Fast; no CuPy needed."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.backend.cuda import attention_decode as ad
from tandem.backend.cuda import gdn_seq as gs
from tandem.backend.cuda.decode_slots import (SLOT_FIELDS, reference_attention_slots, reference_gdn_slots,
                                              slot_table, table_chunks)
from tandem.backend.kv_rows import write_rows

THETA, EPS = 1e7, 1e-6
H, HKV, D, RD = 4, 2, 32, 16


def test_slot_table_gives_each_slot_its_own_chunks() -> None:
    table = slot_table([0, 63, 64, 4096, 1000], [0, 0, 5, 0, -3], [4, 0, 1, 3, 2])
    assert table.shape == (5, SLOT_FIELDS) and table.dtype == np.int32
    assert table[:, 0].tolist() == [0, 63, 64, 4096, 1000]
    assert table[:, 1].tolist() == [0, 63, 69, 4096, 997]
    assert table[:, 2].tolist() == [4, 0, 1, 3, 2]
    chunks = [1, 1, 2, 65, 16]  # pos // 64 + 1: split on absolute positions
    assert table[:, 3].tolist() == [0, 1, 2, 4, 69]
    assert table_chunks(table) == (sum(chunks), 65)


@pytest.mark.parametrize("bad", [([1, 2], [0], [0, 1]), ([1, 2], [0, 0], [1, 1]), ([-1], [0], [0]),
                                 ([3], [-4], [0]), ([3], [0], [-1])])
def test_slot_table_refuses_bad_slots(bad: tuple[list[int], list[int], list[int]]) -> None:
    with pytest.raises(ValueError):
        slot_table(*bad)


def _caches(rng: np.random.Generator, rows: int, kv: str) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((2, rows, HKV, D)).astype(np.float32)
    if kv == "fp32":
        return x[0].copy(), x[1].copy()
    k, v = np.zeros((rows, HKV, D), np.uint16), np.zeros((rows, HKV, D), np.uint16)
    write_rows(k, 0, x[0])
    write_rows(v, 0, x[1])
    return k, v


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_attention_twin_is_each_slot_alone(kv: str) -> None:
    rng = np.random.default_rng(1)
    positions, shifts, rows = [0, 64, 130, 65, 7], [0, 0, 3, 0, -2], [2, 5, 0, 3, 6]
    r = 7
    qg = rng.standard_normal((r, H, 2 * D)).astype(np.float32)
    k_new = rng.standard_normal((r, HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((r, HKV, D)).astype(np.float32)
    q_norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    k_norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    caches = [_caches(rng, 140, kv) for _ in positions]
    alone = [(k.copy(), v.copy()) for k, v in caches]
    y = reference_attention_slots(qg, k_new, v_new, q_norm, k_norm, RD, THETA, [c[0] for c in caches],
                                  [c[1] for c in caches], positions, shifts, rows, EPS)
    assert y.shape == (r, H * D) and y.dtype == np.float32
    for s, row in enumerate(rows):
        want = ad.reference_step(qg[row], k_new[row], v_new[row], q_norm, k_norm, RD, THETA, alone[s][0],
                                 alone[s][1], positions[s], EPS, rope_shift=shifts[s])
        np.testing.assert_array_equal(y[row], want)
        np.testing.assert_array_equal(caches[s][0], alone[s][0])
        np.testing.assert_array_equal(caches[s][1], alone[s][1])
    assert not y[[1, 4]].any()  # rows of no slot
    # a slot's row beside others (fewer, reordered, other rows) equals its row alone
    pair = [(k.copy(), v.copy()) for k, v in (alone[3], alone[0])]
    beside = reference_attention_slots(qg, k_new, v_new, q_norm, k_norm, RD, THETA, [c[0] for c in pair],
                                       [c[1] for c in pair], [positions[3] + 1, positions[0] + 1], [0, 0], [6, 2], EPS)
    solo = (alone[0][0].copy(), alone[0][1].copy())
    lone = reference_attention_slots(qg, k_new, v_new, q_norm, k_norm, RD, THETA, [solo[0]], [solo[1]],
                                     [positions[0] + 1], [0], [2], EPS)
    np.testing.assert_array_equal(beside[2], lone[2])


def test_gdn_twin_is_each_slot_alone() -> None:
    rng = np.random.default_rng(2)
    hk, hv, dk, dv, taps = 2, 4, 32, 32, 4
    c = 2 * hk * dk + hv * dv
    r, rows = 6, [4, 0, 5, 2]
    mixed = rng.standard_normal((r, c)).astype(np.float32)
    a = rng.standard_normal((r, hv)).astype(np.float32)
    b = rng.standard_normal((r, hv)).astype(np.float32)
    z = rng.standard_normal((r, hv * dv)).astype(np.float32)
    conv_w = (0.3 * rng.standard_normal((c, taps))).astype(np.float32)
    a_log = rng.standard_normal(hv).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    tails = [rng.standard_normal((taps - 1, c)).astype(np.float32) for _ in rows]
    states = [(0.1 * rng.standard_normal((hv, dk, dv))).astype(np.float32) for _ in rows]
    alone_tails, alone_states = [t.copy() for t in tails], [s.copy() for s in states]
    y = reference_gdn_slots(mixed, tails, conv_w, a, b, a_log, dt_bias, z, norm_w, states, hk, EPS, rows)
    assert y.shape == (r, hv * dv) and y.dtype == np.float32
    for s, row in enumerate(rows):
        sl = slice(row, row + 1)
        want = gs.reference_prefill(mixed[sl], alone_tails[s], conv_w, a[sl], b[sl], a_log, dt_bias, z[sl], norm_w,
                                    alone_states[s], hk, EPS)
        np.testing.assert_array_equal(y[sl], want)
        np.testing.assert_array_equal(tails[s], alone_tails[s])
        np.testing.assert_array_equal(states[s], alone_states[s])
    assert not y[[1, 3]].any()
