"""ModelState: preallocated sections and views, signature across models, copy_from as a restore.

Source: tandem/models/state.py (DESIGN.md, "State: sections and views").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.state import BufferSpec, ModelState
from tools.make_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> Qwen3_5Model:
    return Qwen3_5Model.load(tiny_ckpt)


def test_buffers_are_preallocated_with_model_shapes(model: Qwen3_5Model) -> None:
    state = model.new_state(100)
    hp = model.hp
    assert state.length == 0 and state.max_len == 100
    names = [s.name for s in state.specs]
    assert names == ["layers.0.conv", "layers.0.ssm", "layers.1.conv", "layers.1.ssm", "layers.2.conv",
                     "layers.2.ssm", "layers.3.k", "layers.3.v"]
    assert state.buffers["layers.0.conv"].shape == (hp.linear_conv_kernel_dim - 1, hp.conv_dim) == (3, 128)
    assert state.buffers["layers.0.ssm"].shape == (4, 16, 16)
    assert state.buffers["layers.3.k"].shape == (100, 2, 32)
    assert all(b.dtype == np.float32 and not b.any() for b in state.buffers.values())
    assert state.nbytes() == 4 * (3 * (3 * 128 + 4 * 16 * 16) + 2 * 100 * 2 * 32)
    kinds = {s.name: s.kind for s in state.specs}
    assert kinds["layers.0.ssm"] == "section" and kinds["layers.3.v"] == "view"


def test_prefill_and_decode_write_in_place(model: Qwen3_5Model) -> None:
    state = model.new_state(40)
    before = {n: (id(b), b.ctypes.data) for n, b in state.buffers.items()}
    model.prefill(state, list(range(1, 21)))
    for t in (5, 6, 7):
        model.decode(state, t)
    assert state.length == 23
    assert {n: (id(b), b.ctypes.data) for n, b in state.buffers.items()} == before
    assert state.buffers["layers.3.k"][:23].any(axis=(1, 2)).all()
    assert not state.buffers["layers.3.k"][23:].any()  # rows past the length are untouched
    state.reset()
    assert state.length == 0 and not any(b.any() for b in state.buffers.values())
    assert {n: (id(b), b.ctypes.data) for n, b in state.buffers.items()} == before


def test_signature_ignores_max_len_and_refuses_other_models(model: Qwen3_5Model, tmp_path: Path) -> None:
    assert model.new_state(10).signature == model.new_state(500).signature
    other = Qwen3_5Model.load(write_checkpoint(tmp_path, linear_value_head_dim=8, with_vision=False,
                                               with_mtp=False, num_shards=1))
    a, b = model.new_state(10), other.new_state(10)
    assert a.signature != b.signature
    with pytest.raises(ValueError, match="signature mismatch"):
        a.copy_from(b)


def test_copy_from_restores_and_continues_bitwise(model: Qwen3_5Model) -> None:
    prompt = [7, 3, 99, 250, 4, 18, 1, 300, 42]
    state = model.new_state(30)
    model.prefill(state, prompt)
    snap = model.new_state(len(prompt))  # a snapshot sized to the used length
    snap.copy_from(state)
    assert snap.length == len(prompt)
    for name in snap.buffers:
        np.testing.assert_array_equal(snap.buffers[name][: snap.max_len], state.buffers[name][: snap.max_len])
    continued = [model.decode(state, t) for t in (11, 12, 13)]
    restored = model.new_state(30)
    restored.copy_from(snap)
    again = [model.decode(restored, t) for t in (11, 12, 13)]
    for x, y in zip(continued, again):
        np.testing.assert_array_equal(x, y)
    for name in state.buffers:
        np.testing.assert_array_equal(state.buffers[name], restored.buffers[name])


def test_copy_from_leaves_rows_past_length_and_checks_capacity(model: Qwen3_5Model) -> None:
    src = model.new_state(20)
    model.prefill(src, list(range(1, 16)))
    small = model.new_state(10)
    with pytest.raises(ValueError, match="15 tokens does not fit max_len 10"):
        small.copy_from(src)
    dst = model.new_state(20)
    dst.buffers["layers.3.k"][15:] = 5.0
    dst.copy_from(src)
    assert (dst.buffers["layers.3.k"][15:] == 5.0).all()  # only the used rows of a view are copied
    np.testing.assert_array_equal(dst.buffers["layers.3.k"][:15], src.buffers["layers.3.k"][:15])


def test_state_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        ModelState([], 0)
    with pytest.raises(ValueError, match="kind must be 'section' or 'view'"):
        ModelState([BufferSpec("x", (2,), "float32", "other")], 4)
    with pytest.raises(ValueError, match="axis 0 is 3, expected max_len 4"):
        ModelState([BufferSpec("x", (3, 2), "float32", "view")], 4)


def test_state_overflow_is_refused(model: Qwen3_5Model) -> None:
    state = model.new_state(4)
    model.prefill(state, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="exceed the state's capacity of 4"):
        model.decode(state, 5)
    assert state.length == 4
