"""The embedded default model, run by the engine, writes transformers' greedy text on its 10 held-out prompts.

transformers runs in float32 with a full forward per step (see tests/test_parity.py for why not its cached
generate). The smallest top-1 margin seen along the reference's path is printed (run with -s).
"""

from __future__ import annotations

import json

import pytest

from tandem.engine import DEFAULT_MODEL, Engine
from tandem.sampling import SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hf_reference import load_hf_causal_lm  # noqa: E402
from test_parity import hf_greedy_check  # noqa: E402

NEW_TOKENS = 64

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="no embedded model")]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_default_model_greedy_text_matches_transformers(kv_dtype: str) -> None:
    """Greedy text equals transformers' (fp32) with the KV cache in fp32 and in bf16 (the default); the smallest
    top-1 margin of each is printed (run with -s)."""
    engine = Engine.from_pretrained(kv_dtype=kv_dtype)
    assert engine.tokenizer is not None
    hf = load_hf_causal_lm(DEFAULT_MODEL)
    prompts = json.loads((DEFAULT_MODEL / "heldout_prompts.json").read_text())
    assert len(prompts) == 10
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    margins = []
    for text in prompts:
        ids = engine.encode_prompt(text)
        done = engine.complete(ids, params)
        ref, margin = hf_greedy_check(hf, ids, done.token_ids)
        assert done.token_ids == ref
        assert done.text == engine.tokenizer.decode(ref)
        margins.append(margin)
    print(f"\n[default model, {kv_dtype} KV] greedy text equal on {len(prompts)} held-out prompts x {NEW_TOKENS} "
          f"tokens; smallest top-1 margin {min(margins):.4g} logits")
