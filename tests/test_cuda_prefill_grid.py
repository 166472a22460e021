"""The tensor-core prefill with the chunked GDN scan (``TensorCorePrefill(gdn_scan="chunked")``, cuda/gdn_chunk.cu)
on the embedded default model: the contract's clause 2 on the 64-token grid, and the prefix cache under it.

Checks, bit for bit: a ~3k-token prompt prefilled in one call, in chunks of other sizes (multiples of 64) and in
calls cut at multiples of 64, and resumed from each 256-token grid snapshot, gives identical states and last logits;
the model built with ``GDN_SCAN = "chunked"`` declares ``prefill_grid`` 64; through a prefix cache, prompts of
several lengths (a retry, an extension, a branch) restore at a multiple of 64 and end with a cold prefill's state
and logits. And the chunked and recurrent scans' logits agree at the argmax (the margin recorded).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.cache.sequence import SequenceCache  # noqa: E402
from tandem.cache.store import PrefixCache  # noqa: E402
from tandem.engine import DEFAULT_MODEL, Engine  # noqa: E402
from tandem.models.qwen3_5.cuda_prefill import TensorCorePrefill  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU"),
              pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="no embedded model")]

PROMPT = 3000
GRID = 256
MB = 1 << 20


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(device="cuda", cache="off", max_context=4096)


@pytest.fixture(scope="module")
def ids(engine: Engine) -> list[int]:
    return np.random.default_rng(64).integers(0, engine.vocab_size, PROMPT).tolist()


@pytest.fixture()
def chunked(engine: Engine) -> Any:
    """The engine's model with the chunked GDN scan (its capabilities re-declared), restored afterwards."""
    model = engine.model
    saved_tc, saved_caps = model._tc, model.capabilities
    model.GDN_SCAN = "chunked"
    model._tc = None
    model.capabilities = model._capabilities()
    try:
        yield model
    finally:
        del model.GDN_SCAN
        model._tc, model.capabilities = saved_tc, saved_caps


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


def test_the_model_declares_the_grid(chunked: Any) -> None:
    tc = chunked.tensor_core_prefill()
    assert tc is not None and tc.gdn_scan == "chunked" and tc.grid == 64
    caps = chunked.capabilities
    assert caps.prefill_chunk_invariant and caps.prefill_grid == 64 and not caps.prefill_matches_decode


def test_one_call_chunks_and_grid_cuts_give_the_same_bits(chunked: Any, ids: list[int]) -> None:
    want_state, want = _prefill(chunked, ids, [])
    for cuts, rows in (([], 512), ([], 320), ([64, 704, 2944], None), ([192, 256, 320], 1024), ([64 * 17], 128)):
        state, logits = _prefill(chunked, ids, cuts, rows)
        assert np.array_equal(logits.view(np.uint32), want.view(np.uint32)), (cuts, rows)
        assert_states_equal(state, want_state)


def test_resumed_from_every_grid_snapshot(chunked: Any, ids: list[int]) -> None:
    want_state, want = _prefill(chunked, ids, [])
    live = chunked.new_state(len(ids) + 1)
    for g in range(GRID, PROMPT, GRID):
        chunked.prefill(live, ids[live.length:g])
        resumed = chunked.new_state(len(ids) + 1)
        resumed.copy_from(live)  # what a cache restore does
        logits = cp.asnumpy(chunked.prefill(resumed, ids[g:]))
        assert np.array_equal(logits.view(np.uint32), want.view(np.uint32)), g
        assert_states_equal(resumed, want_state)


def test_prefix_cache_restores_on_the_grid(chunked: Any, ids: list[int]) -> None:
    cache = PrefixCache(GRID, 512 * MB)
    other = np.random.default_rng(65).integers(0, 1000, 300).tolist()
    # (prompt, tokens restored): a prompt end keeps its snapshot at the multiple of 64 before it; a branch at 700
    # restores the grid block before it
    cases = [(ids[:1000], 0), (ids[:1000], 960), (ids[:1300], 960), (ids[:1300], 1280), (ids[:700] + other, 512)]
    for prompt, expect in cases:
        cache.begin("")
        seq = SequenceCache(chunked, cache, GRID, "", None)
        state = chunked.new_state(len(prompt) + 1)
        logits = cp.asnumpy(seq.prefill(state, prompt))
        cache.end()
        assert seq.cached_tokens == expect, len(prompt)
        ref_state, ref = _prefill(chunked, prompt, [])
        assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32)), len(prompt)
        assert_states_equal(state, ref_state)


def test_chunked_and_recurrent_scans_agree_at_the_argmax(engine: Engine, chunked: Any, ids: list[int]) -> None:
    _, wy = _prefill(chunked, ids[:700], [])
    saved = chunked._tc
    chunked._tc = TensorCorePrefill(chunked, saved.chunk_rows, chunked.PREFILL_WEIGHTS, "recurrent")
    try:
        _, rec = _prefill(chunked, ids[:700], [])
    finally:
        chunked._tc = saved
    diff = float(np.max(np.abs(wy - rec)))
    # the two scans round differently: their top tokens agree unless the reference's top logits lie closer together
    # than the two differ (a random-token prompt can leave a near-tie)
    assert rec[int(np.argmax(wy))] >= float(np.max(rec)) - 2 * diff
    rel = diff / float(np.max(np.abs(rec)))
    top = np.sort(rec)[-2:]
    record("cuda_prefill_chunked_vs_recurrent", max_rel_logit_diff=rel, top1_margin=float(top[1] - top[0]))
    assert rel < 0.05
