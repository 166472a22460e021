"""The chunk-invariant prefill on the GPU (tandem/models/qwen3_5/cuda_prefill.py) on the embedded default model.

The contract (docs/architecture.md, "Exactness", clause 2): the state and logits after prefilling t[0:n] depend on
those tokens alone. Checks, bit for bit: a ~3k-token prompt prefilled in one call, in chunks of two other sizes, in
calls cut off the grid, and resumed from each 256-token grid snapshot (a state copied at that length, as a cache
restore does) give identical states (every buffer) and last logits; the model declares the contract
(``prefill_chunk_invariant``) and no longer ``prefill_matches_decode``; the fallback path (``TC_PREFILL`` off) keeps
decode's bits; the two paths' logits agree at the argmax; "resident" bf16 weights give the "layer" mode's bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.engine import DEFAULT_MODEL, Engine  # noqa: E402
from tandem.models.qwen3_5.cuda_prefill import TensorCorePrefill  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU"),
              pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="no embedded model")]

PROMPT = 3000
GRID = 256


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(device="cuda", cache="off", max_context=4096)


@pytest.fixture(scope="module")
def ids(engine: Engine) -> list[int]:
    return np.random.default_rng(46).integers(0, engine.vocab_size, PROMPT).tolist()


def _prefill(model: Any, ids: list[int], cuts: list[int], chunk_rows: int | None = None) -> tuple[Any, Any]:
    """A fresh state prefilled by calls ending at ``cuts`` (then the end), chunks of ``chunk_rows``."""
    saved = model._tc
    if chunk_rows is not None:
        model._tc = TensorCorePrefill(model, chunk_rows, model.PREFILL_WEIGHTS)
    try:
        state = model.new_state(len(ids) + 1)
        logits = None
        edges = [0, *cuts, len(ids)]
        for a, b in zip(edges, edges[1:]):
            logits = model.prefill(state, ids[a:b])
        return state, cp.asnumpy(logits)
    finally:
        model._tc = saved


def test_the_model_declares_the_contract(engine: Engine) -> None:
    caps = engine.model.capabilities
    assert engine.model.tensor_core_prefill() is not None
    assert caps.prefill_chunk_invariant and not caps.prefill_matches_decode


def test_one_call_chunks_and_cuts_give_the_same_bits(engine: Engine, ids: list[int]) -> None:
    model = engine.model
    want_state, want = _prefill(model, ids, [])
    for cuts, rows in (([], 512), ([], 300), ([1, 700, 2999], None), ([255, 256, 257], 1024), ([64 * 17 + 3], 96)):
        state, logits = _prefill(model, ids, cuts, rows)
        assert np.array_equal(logits.view(np.uint32), want.view(np.uint32)), (cuts, rows)
        assert_states_equal(state, want_state)


def test_resumed_from_every_grid_snapshot(engine: Engine, ids: list[int]) -> None:
    model = engine.model
    want_state, want = _prefill(model, ids, [])
    live = model.new_state(len(ids) + 1)
    for g in range(GRID, PROMPT, GRID):
        model.prefill(live, ids[live.length:g])
        resumed = model.new_state(len(ids) + 1)
        resumed.copy_from(live)  # what a cache restore does
        logits = cp.asnumpy(model.prefill(resumed, ids[g:]))
        assert np.array_equal(logits.view(np.uint32), want.view(np.uint32)), g
        assert_states_equal(resumed, want_state)


def test_fallback_keeps_decode_bits_and_agrees_at_the_argmax(engine: Engine, ids: list[int]) -> None:
    model = engine.model
    tc_state, tc_logits = _prefill(model, ids[:700], [])
    model.TC_PREFILL = False
    try:
        assert model.tensor_core_prefill() is None
        state = model.new_state(702)
        exact = cp.asnumpy(model.prefill(state, ids[:700]))
        decoded = model.new_state(702)
        model.prefill(decoded, ids[:699])
        last = cp.asnumpy(model.decode(decoded, ids[699]))
        assert np.array_equal(last, exact)  # the fallback: prefill == decode, bit for bit
    finally:
        del model.TC_PREFILL
    assert int(np.argmax(tc_logits)) == int(np.argmax(exact))
    rel = float(np.max(np.abs(tc_logits - exact)) / np.max(np.abs(exact)))
    top = np.sort(exact)[-2:]
    record("cuda_prefill_tc_vs_decode_bits", max_rel_logit_diff=rel, top1_margin=float(top[1] - top[0]))
    assert rel < 0.05


def test_resident_weights_give_the_layer_bits(engine: Engine, ids: list[int]) -> None:
    model = engine.model
    want_state, want = _prefill(model, ids[:900], [])
    saved = model._tc
    model._tc = TensorCorePrefill(model, saved.chunk_rows, "resident")
    try:
        state, logits = _prefill(model, ids[:900], [450])
        assert model._tc.resident_bytes() > 0
    finally:
        model._tc = saved
    assert np.array_equal(logits.view(np.uint32), want.view(np.uint32))
    assert_states_equal(state, want_state)
