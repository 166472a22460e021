"""The CPU engine's prefill is chunk-invariant (docs/architecture.md, "Exactness", clause 2) on the embedded default
model: a 1.6k-token prompt (seven attention key blocks, 25 GDN pieces, six grid snapshots) prefilled in one call, in
calls cut anywhere (off the 64-token pieces too), and resumed from grid snapshots (a state copied at a grid length,
as a cache restore does) gives identical states (every buffer) and last logits, bit for bit. (The NumPy prefill has
decode's bits, which implies this; the GPU's tensor-core prefill is checked the same way, on 3k tokens, in
tests/test_cuda_prefill_chunks.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tandem.engine import DEFAULT_MODEL, Engine

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="no embedded model")

PROMPT = 1600
GRID = 256


@pytest.fixture(scope="module")
def model() -> Any:
    return Engine.from_pretrained(device="cpu", cache="off", max_context=4096).model


@pytest.fixture(scope="module")
def ids(model: Any) -> list[int]:
    return np.random.default_rng(46).integers(0, model.hp.vocab_size, PROMPT).tolist()


@pytest.fixture(scope="module")
def whole(model: Any, ids: list[int]) -> tuple[Any, np.ndarray]:
    state = model.new_state(PROMPT + 1)
    return state, np.asarray(model.prefill(state, ids))


def _assert_same(state: Any, logits: Any, want: tuple[Any, np.ndarray]) -> None:
    assert np.array_equal(np.asarray(logits).view(np.uint32), want[1].view(np.uint32))
    assert state.length == want[0].length
    for spec in want[0].specs:
        a, b = state.buffers[spec.name], want[0].buffers[spec.name]
        if spec.kind == "view":
            a, b = a[:state.length], b[:state.length]
        assert np.array_equal(a, b), spec.name


def test_calls_cut_anywhere_give_one_prefill(model: Any, ids: list[int], whole: tuple[Any, np.ndarray]) -> None:
    state = model.new_state(PROMPT + 1)
    logits = None
    edges = [0, 1, 65, 700, 1599, PROMPT]
    for a, b in zip(edges, edges[1:]):
        logits = model.prefill(state, ids[a:b])
    _assert_same(state, logits, whole)


def test_resumed_from_grid_snapshots(model: Any, ids: list[int], whole: tuple[Any, np.ndarray]) -> None:
    live = model.new_state(PROMPT + 1)
    for g in range(GRID, PROMPT, GRID):
        model.prefill(live, ids[live.length:g])
        if g % (4 * GRID) == 0 or g == GRID:  # resume from a few of them (each resume prefills the rest)
            resumed = model.new_state(PROMPT + 1)
            resumed.copy_from(live)
            _assert_same(resumed, model.prefill(resumed, ids[g:]), whole)
