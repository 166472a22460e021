"""The sampler on verified logits is right (issue 5, "Sampling"): on a small-vocabulary model, tokens drawn with
``choose_token`` from a verified tree node's logits follow softmax(logits / T) after the masks (chi-square over
20k draws), and the node's logits are a plain decode's, so sampled speculation draws from the plain distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.sampling import PenaltyState, SamplingParams, choose_token, process_logits
from test_sampling import chi2_sf
from tools.make_checkpoint import write_checkpoint

NUM_DRAWS = 20000


def test_sampled_distribution_on_verified_logits(tmp_path: Path) -> None:
    model = Qwen3_5Model.load(write_checkpoint(tmp_path / "v16", vocab_size=16, init_std=0.1, lm_head_std=0.1,
                                               num_shards=1, with_vision=False))
    state = model.new_state(16)
    model.prefill(state, [1, 2, 3, 4])
    logits = model.verify_tree(state, model.new_tree_scratch(4), [5, 6, 7], [-1, 0, 0])
    node_logits = logits[2]  # the second child of the root: position 5
    ref_state = model.new_state(16)
    ref_state.copy_from(state)
    model.decode(ref_state, 5)
    assert np.array_equal(node_logits, model.decode(ref_state, 7))
    penalties = PenaltyState(16, [1, 2, 3, 4], repetition_penalty=1.2, presence_penalty=0.5)
    penalties.add(5)
    for params in (SamplingParams(temperature=0.7, top_k=10, top_p=0.95, repetition_penalty=1.2,
                                  presence_penalty=0.5), SamplingParams(temperature=1.0)):
        pen = penalties if params.repetition_penalty != 1.0 else None
        x = process_logits(node_logits, params, pen).astype(np.float64)
        kept = np.isfinite(x)
        expected = np.where(kept, np.exp(x - x[kept].max()), 0.0)
        expected = expected / expected.sum() * NUM_DRAWS
        counts = np.zeros(16)
        for seed in range(NUM_DRAWS):
            counts[choose_token(node_logits, params, pen, seed, 6)] += 1
        assert counts[~kept].sum() == 0, "a masked token was drawn"
        stat = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
        p = chi2_sf(stat, int(kept.sum()) - 1)
        assert p > 0.01, f"chi-square {stat:.1f} on {int(kept.sum()) - 1} dof: p = {p:.4f}"
