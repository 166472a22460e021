"""The joint pass's batched decode launches on a GPU (tandem/backend/cuda/decode_slots.py,
tandem/models/qwen3_5/cuda_joint_slots.py): every slot's attention in one launch a layer (two with a separate
combine) and its GDN update in two, each slot with the bits of its decode alone.

Kernel level: ``AttentionSlots`` over 1, 2, 5 and 16 slots at positions crossing the chunk boundaries (0, 63, 64,
65, 1000, 4095, 4096, 4097, ...: one chunk to two, 64 to 65, the split decode's switch), fp32 and bf16 caches, plain
and split outputs, fused or not, with rotary shifts, on permuted joint rows, over several steps: each slot's output
row and cache rows equal attention_decode_step and DecodeStep alone, bit for bit; the rows of no slot stay
NaN; a growth of the partials between steps. ``GDNSlots`` likewise against gdn_decode (y or xs, tail, state).
Model level: joint_forward of decode steps with ``JOINT_BATCHED`` (planned, several replays, and unplanned, and beside
verify trees) gives each slot the logits and state of its decode alone; a slot's logits do not change when the other
slots change; the plain-output path (no split operand) equals the per-slot loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal  # noqa: E402
from tandem.backend.cuda import attention_decode as ad  # noqa: E402
from tandem.backend.cuda import gdn_seq as gs  # noqa: E402
from tandem.backend.cuda.checks import max_rel_error  # noqa: E402
from tandem.backend.cuda.decode_slots import AttentionSlots, GDNSlots, reference_attention_slots  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.dtypes import f32_to_bf16  # noqa: E402
from tandem.models.protocol import JointItem  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

THETA, EPS = 1e7, 1e-6
SHAPES = [(8, 2, 128, 32), (24, 4, 256, 64)]  # (H, Hkv, D, rotary dims); the second Qwen3.5-27B's
# slot positions at the first step: across one chunk to two (63, 64), 64 chunks to 65 (4095, 4096), 1000 ...
POSITIONS = [1, 63, 64, 65, 1000, 4097, 4095, 4096, 0, 127, 128, 2048, 300, 3000, 4159, 4160]
SHIFTS = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, -5, 0, 0]  # image prompts' rotary shifts on two slots
COUNTS = [1, 2, 5, 16]
OUTPUTS = [(None, False), (None, True), ("f16", False), ("f16p", True), ("bf16", False)]  # (split, fused)
STEPS = 3


def _bits(a: Any) -> np.ndarray:
    host = np.ascontiguousarray(cp.asnumpy(a))
    return host.view(np.uint32) if host.dtype == np.float32 else host


def _cache(rng: np.random.Generator, rows: int, filled: int, hkv: int, d: int, kv: str) -> np.ndarray:
    """`rows` rows, the first `filled` random, the rest NaN (0xFFFF bits for bf16): a read past them shows."""
    x = rng.standard_normal((filled, hkv, d)).astype(np.float32)
    if kv == "fp32":
        c = np.full((rows, hkv, d), np.nan, dtype=np.float32)
        c[:filled] = x
    else:
        c = np.full((rows, hkv, d), 0xFFFF, dtype=np.uint16)
        c[:filled] = f32_to_bf16(x)
    return c


def _out(split: str | None, rows: int, width: int) -> Any:
    """A NaN-poisoned joint output: [R, width] float32, or the split operand [R, P, width] uint16 (0xFFFF)."""
    if split is None:
        return cp.full((rows, width), np.nan, dtype=cp.float32)
    return cp.full((rows, 3 if split == "bf16" else 2, width), 0xFFFF, dtype=cp.uint16)


@pytest.mark.parametrize("output", range(len(OUTPUTS)), ids=[f"{s}-{'fused' if f else 'two'}" for s, f in OUTPUTS])
@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("shape", SHAPES, ids=["small", "27b"])
def test_attention_slots_equal_each_slot_alone(shape: tuple[int, int, int, int], count: int, kv: str,
                                               output: int) -> None:
    split, fused = OUTPUTS[output]
    h, hkv, d, rd = shape
    rng = np.random.default_rng(count * 31 + output)
    layers, r = 2, count + 3
    rows = [int(x) for x in rng.permutation(r)[:count]]
    positions, shifts = POSITIONS[:count], SHIFTS[:count]
    host = [[_cache(rng, positions[s] + STEPS + 5 * s + 1, positions[s], hkv, d, kv) for _ in range(2 * layers)]
            for s in range(count)]
    joint = [[cp.asarray(c) for c in slot] for slot in host]
    alone = [[cp.asarray(c) for c in slot] for slot in host]
    planned = [[cp.asarray(c) for c in slot] for slot in host]
    slots = AttentionSlots([[joint[s][2 * n] for s in range(count)] for n in range(layers)],
                           [[joint[s][2 * n + 1] for s in range(count)] for n in range(layers)], h, fused)
    q_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    k_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    for t in range(STEPS):
        pos = [p + t for p in positions]
        slots.begin(pos, shifts, rows)
        for n in range(layers):
            qg = cp.asarray(rng.standard_normal((r, h, 2 * d)).astype(np.float32))
            k_new = cp.asarray(rng.standard_normal((r, hkv, d)).astype(np.float32))
            v_new = cp.asarray(rng.standard_normal((r, hkv, d)).astype(np.float32))
            y = _out(split, r, h * d)
            if split is None:
                step = slots.step(n, qg, k_new, v_new, q_norm, k_norm, freq, EPS, out=y)
            else:
                step = slots.step(n, qg, k_new, v_new, q_norm, k_norm, freq, EPS, split=split, xs=y)
            step()
            assert step.result is y
            got = _bits(y)
            for s, row in enumerate(rows):
                kc, vc = alone[s][2 * n], alone[s][2 * n + 1]
                want = ad.attention_decode_step(qg[row], k_new[row], v_new[row], q_norm, k_norm, freq, kc, vc, pos[s],
                                                EPS, split=split, fused=fused, rope_shift=shifts[s])
                want_bits = _bits(want).reshape(got[row].shape)
                np.testing.assert_array_equal(got[row], want_bits, err_msg=f"step {t} layer {n} slot {s}")
                kp, vp = planned[s][2 * n], planned[s][2 * n + 1]
                ds = ad.DecodeStep(qg[row], k_new[row], v_new[row], q_norm, k_norm, freq, kp, vp, EPS, split=split,
                                   fused=fused)
                ds(pos[s], shifts[s])
                np.testing.assert_array_equal(got[row], _bits(ds.result).reshape(got[row].shape),
                                              err_msg=f"step {t} layer {n} slot {s}: DecodeStep")
                for a, b in ((joint[s][2 * n], kc), (joint[s][2 * n + 1], vc)):
                    np.testing.assert_array_equal(_bits(a[:pos[s] + 1]), _bits(b[:pos[s] + 1]))
            others = [x for x in range(r) if x not in rows]
            poison = _bits(_out(split, 1, h * d))[0]
            for x in others:
                np.testing.assert_array_equal(got[x], poison, err_msg=f"row {x} of no slot was written")


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_attention_slots_against_the_reference(kv: str) -> None:
    """The twin (loop over slots of reference_step) on NaN-poisoned outputs: relative 1e-5 (bf16 rows 2e-4)."""
    h, hkv, d, rd = SHAPES[0]
    rng = np.random.default_rng(5)
    r = 6
    rows, positions, shifts = [3, 0, 5, 1, 2], [0, 64, 700, 4100, 65], [0, 3, 0, 0, -2]
    host = [(_cache(rng, p + 1, p, hkv, d, kv), _cache(rng, p + 1, p, hkv, d, kv)) for p in positions]
    dev = [(cp.asarray(k), cp.asarray(v)) for k, v in host]
    slots = AttentionSlots([[k for k, _ in dev]], [[v for _, v in dev]], h)
    slots.begin(positions, shifts, rows)
    qg = rng.standard_normal((r, h, 2 * d)).astype(np.float32)
    k_new = rng.standard_normal((r, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((r, hkv, d)).astype(np.float32)
    q_norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    k_norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    y = _out(None, r, h * d)
    slots.step(0, cp.asarray(qg), cp.asarray(k_new), cp.asarray(v_new), cp.asarray(q_norm), cp.asarray(k_norm),
               cp.asarray(ad.inv_freq(rd, THETA)), EPS, out=y)()
    ref = reference_attention_slots(qg, k_new, v_new, q_norm, k_norm, rd, THETA, [k for k, _ in host],
                                    [v for _, v in host], positions, shifts, rows, EPS)
    got = cp.asnumpy(y)
    assert max_rel_error(got[rows], ref[rows]) <= (1e-5 if kv == "fp32" else 2e-4)
    assert np.isnan(got[4]).all()


def test_attention_slots_partials_grow_between_calls() -> None:
    """One layer's step, built at short positions, called after the partials grew (a new buffer): the same bits as
    each slot alone (its launches re-pointed at the new partials)."""
    h, hkv, d, rd = SHAPES[0]
    rng = np.random.default_rng(9)
    count, r, rows_cached = 3, 3, 6000
    host = [(_cache(rng, rows_cached, rows_cached, hkv, d, "fp32"), _cache(rng, rows_cached, rows_cached, hkv, d,
                                                                           "fp32")) for _ in range(count)]
    joint = [(cp.asarray(k), cp.asarray(v)) for k, v in host]
    alone = [(cp.asarray(k), cp.asarray(v)) for k, v in host]
    slots = AttentionSlots([[k for k, _ in joint]], [[v for _, v in joint]], h)
    qg = cp.asarray(rng.standard_normal((r, h, 2 * d)).astype(np.float32))
    k_new = cp.asarray(rng.standard_normal((r, hkv, d)).astype(np.float32))
    v_new = cp.asarray(rng.standard_normal((r, hkv, d)).astype(np.float32))
    q_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    k_norm = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    freq = cp.asarray(ad.inv_freq(rd, THETA))
    y = _out(None, r, h * d)
    slots.begin([1, 2, 3], [0, 0, 0], [0, 1, 2])
    step = slots.step(0, qg, k_new, v_new, q_norm, k_norm, freq, EPS, out=y)
    for pos in ([1, 2, 3], [5000, 10, 4500], [5999, 5998, 5997]):
        slots.begin(pos, [0, 0, 0], [2, 0, 1])
        step()
        got = _bits(y)
        for s, row in enumerate([2, 0, 1]):
            want = ad.attention_decode_step(qg[row], k_new[row], v_new[row], q_norm, k_norm, freq, alone[s][0],
                                            alone[s][1], pos[s], EPS)
            np.testing.assert_array_equal(got[row], _bits(want), err_msg=f"positions {pos} slot {s}")


GDN_SHAPES = [(2, 4, 128, 128, 4), (2, 4, 64, 64, 4), (16, 48, 128, 128, 4)]  # (Hk, Hv, dk, dv, K); last: 27B


@pytest.mark.parametrize("split", [None, "f16", "f16p", "bf16"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=["dk128", "dk64", "27b"])
def test_gdn_slots_equal_each_slot_alone(shape: tuple[int, int, int, int, int], count: int,
                                         split: str | None) -> None:
    hk, hv, dk, dv, taps = shape
    c = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(count * 7 + (0 if split is None else len(split)))
    layers, r = 2, count + 2
    rows = [int(x) for x in rng.permutation(r)[:count]]

    def f32(*dims: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal(dims)).astype(np.float32)

    tails = [[f32(taps - 1, c) for _ in range(count)] for _ in range(layers)]
    states = [[f32(hv, dk, dv, scale=0.1) for _ in range(count)] for _ in range(layers)]
    jt, js = [[cp.asarray(x) for x in lt] for lt in tails], [[cp.asarray(x) for x in ls] for ls in states]
    at, as_ = [[cp.asarray(x) for x in lt] for lt in tails], [[cp.asarray(x) for x in ls] for ls in states]
    slots = GDNSlots(jt, js, rows)
    weights = [(cp.asarray(f32(c, taps, scale=0.3)), cp.asarray(f32(hv)), cp.asarray(f32(hv)),
                cp.asarray((1 + 0.1 * rng.standard_normal(dv)).astype(np.float32))) for _ in range(layers)]
    for t in range(STEPS):
        for n in range(layers):
            conv_w, a_log, dt_bias, norm_w = weights[n]
            mixed, a, b, z = (cp.asarray(f32(r, c)), cp.asarray(f32(r, hv)), cp.asarray(f32(r, hv)),
                              cp.asarray(f32(r, hv * dv)))
            y = _out(split, r, hv * dv)
            if split is None:
                got = slots.step(n, mixed, conv_w, a, b, a_log, dt_bias, z, norm_w, hk, EPS, out=y)
            else:
                got = slots.step(n, mixed, conv_w, a, b, a_log, dt_bias, z, norm_w, hk, EPS, split=split, xs=y)
            assert got is y
            bits = _bits(y)
            for s, row in enumerate(rows):
                sl = slice(row, row + 1)
                want = gs.gdn_decode(mixed[sl], at[n][s], conv_w, a[sl], b[sl], a_log, dt_bias, z[sl], norm_w,
                                     as_[n][s], hk, EPS, split=split)
                np.testing.assert_array_equal(bits[row], _bits(want)[0], err_msg=f"step {t} layer {n} slot {s}")
                np.testing.assert_array_equal(_bits(jt[n][s]), _bits(at[n][s]), err_msg=f"slot {s} tail")
                np.testing.assert_array_equal(_bits(js[n][s]), _bits(as_[n][s]), err_msg=f"slot {s} state")
            poison = _bits(_out(split, 1, hv * dv))[0]
            for x in range(r):
                if x not in rows:
                    np.testing.assert_array_equal(bits[x], poison, err_msg=f"row {x} of no slot was written")


# ---- the model: joint_forward with JOINT_BATCHED ----

TINY = dict(layers=4, hidden=512, mlp=1024, vocab=1024, heads=4, kv_heads=2, head_dim=64, gdn_k_heads=4,
            gdn_v_heads=8, gdn_dim=64, conv_taps=4, attn_every=2, rotary_dim=16)
PROMPT_LENGTHS = [1, 63, 64, 65, 1000, 4097, 4094, 127, 2, 300, 4095, 129, 5, 700, 33, 191]
MODEL_STEPS = 4


@pytest.fixture(scope="module", params=[("bf16", "float32"), ("nvfp4", "bfloat16")], ids=["bf16", "nvfp4-kvbf16"])
def model(request: pytest.FixtureRequest) -> Any:
    from bench.decode import build

    cp.random.seed(3)
    fmt, kv = request.param
    return build(fmt, TINY, kv)


def _pair(model: Any, prompts: list[list[int]]) -> tuple[list[Any], list[Any]]:
    joint, alone = [], []
    for p in prompts:
        for group in (joint, alone):
            s = model.new_state(len(p) + MODEL_STEPS + 8)
            model.prefill(s, p)
            group.append(s)
    return joint, alone


def _prompts(rng: np.random.Generator, lengths: list[int]) -> list[list[int]]:
    return [rng.integers(0, TINY["vocab"], n).tolist() for n in lengths]


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
@pytest.mark.parametrize("count", COUNTS)
def test_batched_joint_decode_equals_each_slot_alone(model: Any, count: int, planned: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode passes of `count` slots at the lengths of PROMPT_LENGTHS (crossing 1 → 2 and 64 → 65 chunks over the
    steps), batched; planned: one plan recorded, then replayed with advancing positions."""
    monkeypatch.setattr(type(model), "JOINT_PLANNED", planned)
    monkeypatch.setattr(type(model), "JOINT_BATCHED", True)
    rng = np.random.default_rng(count)
    joint, alone = _pair(model, _prompts(rng, PROMPT_LENGTHS[:count]))
    model.release_joint_plans()
    for step in range(MODEL_STEPS):
        tokens = rng.integers(0, TINY["vocab"], count).tolist()
        got = model.joint_forward([JointItem(s, [t]) for s, t in zip(joint, tokens)])
        for j in range(count):
            want = model.decode(alone[j], tokens[j])
            np.testing.assert_array_equal(_bits(got[j]), _bits(want), err_msg=f"step {step} slot {j}")
    for j in range(count):
        assert_states_equal(joint[j], alone[j])
    if planned:
        assert len(model._joint_plans) == 1  # recorded once, replayed since
    model.release_joint_plans()


def test_a_slots_logits_do_not_depend_on_the_other_slots(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot 0 (the same prompt and tokens) beside two different sets of slots (other lengths, tokens, counts and
    places), planned and unplanned: the same logits, bit for bit."""
    monkeypatch.setattr(type(model), "JOINT_BATCHED", True)
    rng = np.random.default_rng(11)
    mine = _prompts(rng, [1000])[0]
    firsts: list[list[np.ndarray]] = []
    for planned, others, place in ((True, [4097, 64, 5], 0), (True, [63, 2, 700, 4095, 129, 1, 300, 33], 5),
                                   (False, [65], 1), (False, [3000, 127, 4094, 1, 2, 64, 65, 191, 500, 7], 9)):
        monkeypatch.setattr(type(model), "JOINT_PLANNED", planned)
        states, _ = _pair(model, [mine] + _prompts(rng, others))
        order = states[1:place + 1] + [states[0]] + states[place + 1:]
        seen = []
        for step in range(3):
            tokens = rng.integers(0, TINY["vocab"], len(order)).tolist()
            tokens[place] = 17 + step
            got = model.joint_forward([JointItem(s, [t]) for s, t in zip(order, tokens)])
            seen.append(_bits(got[place]))
        firsts.append(seen)
        model.release_joint_plans()
    for seen in firsts[1:]:
        for a, b in zip(seen, firsts[0]):
            np.testing.assert_array_equal(a, b)


def test_batched_decodes_beside_verify_trees_equal_each_item_alone(model: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass with verify trees (the unplanned path): the decode rows batched, the trees per part."""
    monkeypatch.setattr(type(model), "JOINT_BATCHED", True)
    rng = np.random.default_rng(4)
    kinds: list[list[int] | None] = [None, [-1, 0, 1, 1, 0], None, [-1, 0, 0], None, None]
    joint, alone = _pair(model, _prompts(rng, [64, 65, 4096, 63, 1, 1000]))
    items, refs = [], []
    for j, parents in enumerate(kinds):
        if parents is None:
            token = int(rng.integers(0, TINY["vocab"]))
            items.append(JointItem(joint[j], [token]))
            refs.append(model.decode(alone[j], token))
        else:
            tokens = rng.integers(0, TINY["vocab"], len(parents)).tolist()
            items.append(JointItem(joint[j], tokens, parents, model.new_tree_scratch(32)))
            refs.append(model.verify_tree(alone[j], model.new_tree_scratch(32), tokens, parents))
    got = model.joint_forward(items)
    for j, parents in enumerate(kinds):
        np.testing.assert_array_equal(_bits(got[j]), _bits(refs[j]), err_msg=f"item {j}")
        if parents is None:
            assert_states_equal(joint[j], alone[j])
    model.release_joint_plans()


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
@pytest.mark.parametrize("count", [5, 16])
def test_plain_outputs_batched_equal_the_per_slot_loop(model: Any, count: int, planned: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With the mixers' outputs as fp32 rows (no split operand: ``_kind`` None; ≥ 5 rows, the plain layer loop),
    the batched pass equals the per-slot loop (JOINT_BATCHED off), logits and states."""
    from tandem.models.qwen3_5 import cuda_joint

    monkeypatch.setattr(cuda_joint, "_kind", lambda lin: None)
    monkeypatch.setattr(type(model), "JOINT_PLANNED", planned)
    rng = np.random.default_rng(20 + count)
    prompts = _prompts(rng, PROMPT_LENGTHS[:count])
    batched, looped = _pair(model, prompts)
    model.release_joint_plans()
    for step in range(3):
        tokens = rng.integers(0, TINY["vocab"], count).tolist()
        monkeypatch.setattr(type(model), "JOINT_BATCHED", True)
        got = model.joint_forward([JointItem(s, [t]) for s, t in zip(batched, tokens)])
        got_bits = [_bits(g) for g in got]
        monkeypatch.setattr(type(model), "JOINT_BATCHED", False)
        want = model.joint_forward([JointItem(s, [t]) for s, t in zip(looped, tokens)])
        for j in range(count):
            np.testing.assert_array_equal(got_bits[j], _bits(want[j]), err_msg=f"step {step} slot {j}")
    for j in range(count):
        assert_states_equal(batched[j], looped[j])
    model.release_joint_plans()
