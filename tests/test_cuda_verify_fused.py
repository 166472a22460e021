"""Small tree verifies through the decode's fused layer loop (``_layers_fused``; cuda_layer_ops.VERIFY_FUSED) on a GPU.

A verify of at most ``_fused_rows()`` nodes (4 in FP8 / NVFP4, 2 in BF16) adds each residual and norms it in the
epilogue of the GEMV before it (gemv ``matmul_residual_norm`` on T rows) instead of add_rms_norm launches. On small
synthetic models of every weight format (bench/decode.py ``build``, random weights, fused projections): every verify
row equals a plain decode of its node's path bit for bit, recorded and replayed, and equals the unfused verify's
row; the commit of a path leaves the state of plain decodes; trees past the fused size take the unfused loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal, plain_decodes, root_path  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# Two GDN layers and two attention layers; every in-dim a multiple of 128 (NVFP4's chunk) and every fused part's
# rows a multiple of 8 (FP8's concat), small enough to build fast.
TINY = dict(layers=4, hidden=512, mlp=1024, vocab=1024, heads=4, kv_heads=2, head_dim=64, gdn_k_heads=4,
            gdn_v_heads=8, gdn_dim=64, conv_taps=4, attn_every=2, rotary_dim=16)
TREES = [[-1], [-1, 0], [-1, 0, 1], [-1, 0, 0, 1], [-1, 0, 1, 1, 0], [-1, 0, 1, 1, 0, 4],
         [-1, 0, 1, 2, 1, 0, 5, 3], [-1, 0, 1, 2, 1, 0, 5, 3, 7]]  # 1-6, 8, 9 nodes: fused up to _fused_rows()


@pytest.fixture(scope="module", params=["bf16", "fp8", "nvfp4"])
def model(request: pytest.FixtureRequest) -> Any:
    from bench.decode import build

    cp.random.seed(1)
    return build(request.param, TINY)


def test_fused_rows_by_format(model: Any) -> None:
    want = 2 if model.head.fmt == "bf16" else 4
    assert model._fused_rows() == want


@pytest.mark.parametrize("parents", TREES, ids=[f"n{len(t)}" for t in TREES])
def test_small_verify_rows_are_plain_decodes(model: Any, parents: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.models.qwen3_5 import cuda_layer_ops

    rng = np.random.default_rng(len(parents))
    prompt = rng.integers(0, TINY["vocab"], 21).tolist()
    tokens = rng.integers(0, TINY["vocab"], len(parents)).tolist()
    state = model.new_state(len(prompt) + 16)
    model.prefill(state, prompt)
    scratch = model.new_tree_scratch(16)
    got = [cp.asnumpy(model.verify_tree(state, scratch, tokens, parents)) for _ in range(3)]  # record, replay x2
    for g in got[1:]:
        np.testing.assert_array_equal(g.view(np.uint32), got[0].view(np.uint32), err_msg="replay")
    from tandem.backend.cuda.plan import _Bound

    names = [str(s.fn.name) for s in state.verify_plans[(id(scratch), len(parents))].steps if isinstance(s, _Bound)]
    fused = len(parents) <= model._fused_rows()  # the path taken: residual + norm GEMVs, or add_rms_norm launches
    assert any("_resnorm" in name for name in names) == fused and ("add_rms_norm" in names) != fused, names
    for node in range(len(parents)):
        _, want = plain_decodes(model, prompt, [tokens[n] for n in root_path(parents, node)])
        np.testing.assert_array_equal(got[0][node].view(np.uint32), cp.asnumpy(want).view(np.uint32),
                                      err_msg=f"node {node}")
    monkeypatch.setattr(cuda_layer_ops, "VERIFY_FUSED", False)  # the add_rms_norm loop: the same bits
    other = model.new_state(len(prompt) + 16)
    model.prefill(other, prompt)
    unfused = cp.asnumpy(model.verify_tree(other, model.new_tree_scratch(16), tokens, parents))
    np.testing.assert_array_equal(unfused.view(np.uint32), got[0].view(np.uint32), err_msg="unfused")
    monkeypatch.undo()
    path = root_path(parents, len(parents) - 1)
    model.commit(state, scratch, path)
    ref, _ = plain_decodes(model, prompt, [tokens[n] for n in path])
    assert_states_equal(state, ref)
