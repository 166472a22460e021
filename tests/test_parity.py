"""Parity of the NumPy engine with transformers' Qwen3.5 (torch CPU, fp32) on random release-layout checkpoints.

Two shapes: one with GQA (4 query heads on 2 KV heads), tied embeddings and a GDN k/v head ratio of 2; one with
no GQA (equal heads), an untied head and equal GDN heads. Greedy tokens must be identical for 20 prompts x 64 new
tokens; prefill logits within 1e-4 relative error; the smallest top-1 margin is printed (run with -s).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tools.make_checkpoint import dequantize_checkpoint, write_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hf_reference import load_hf_causal_lm  # noqa: E402

SHAPES = {
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                     linear_num_value_heads=4, tie_word_embeddings=True, init_std=0.1, seed=1),
    "mha_untied": dict(hidden_size=48, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=24, linear_num_key_heads=3, linear_num_value_heads=3, intermediate_size=96,
                       tie_word_embeddings=False, init_std=0.1, seed=2),
}
NUM_PROMPTS, NEW_TOKENS = 20, 64


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, object, str]:
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), **SHAPES[request.param])
    return Engine.from_pretrained(path, max_context=512), load_hf_causal_lm(path), request.param


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, 140))).tolist() for _ in range(NUM_PROMPTS)]


def _hf_greedy(hf: object, ids: list[int], n: int) -> tuple[list[int], float]:
    """Greedy continuation by transformers (with its cache) and the smallest top-1 margin along it."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,  # type: ignore[attr-defined]
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    margin = min(float((lambda s: s[0] - s[1])(torch.topk(sc[0].float(), 2).values)) for sc in out.scores)
    return out.sequences[0, len(ids):].tolist(), margin


def test_prefill_logits_match(pair: tuple[Engine, object, str]) -> None:
    engine, hf, _ = pair
    for ids in _prompts(engine.vocab_size, 7)[:5] + [list(range(1, 200))]:
        state = engine.model.new_state(len(ids))
        ours = engine.model.prefill(state, ids, all_logits=True)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().numpy()  # type: ignore[operator]
        rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
        assert rel < 1e-4, f"prefill logits differ: relative error {rel:.2e}"


def test_greedy_tokens_match(pair: tuple[Engine, object, str]) -> None:
    engine, hf, name = pair
    margins = []
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for ids in _prompts(engine.vocab_size, 11):
        ref, margin = _hf_greedy(hf, ids, NEW_TOKENS)
        ours = engine.complete(ids, params).token_ids
        assert ours == ref, f"greedy tokens differ at index {next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)}"
        margins.append(margin)
    print(f"\n[{name}] greedy parity on {NUM_PROMPTS} prompts x {NEW_TOKENS} tokens; "
          f"smallest top-1 margin {min(margins):.4g} logits")


def test_fp8_matches_dequantized_twin(tmp_path: Path) -> None:
    fp8 = write_checkpoint(tmp_path / "fp8", fp8=True, seed=3)
    twin = dequantize_checkpoint(fp8, tmp_path / "twin")
    a = Engine.from_pretrained(fp8)
    b = Engine.from_pretrained(twin)
    ids = list(range(3, 90))
    la = a.model.prefill(a.model.new_state(len(ids)), ids, all_logits=True)
    lb = b.model.prefill(b.model.new_state(len(ids)), ids, all_logits=True)
    np.testing.assert_array_equal(la, lb)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert a.complete(ids, params).token_ids == b.complete(ids, params).token_ids
    hf = load_hf_causal_lm(twin)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    assert float(np.abs(la - ref).max() / np.abs(ref).max()) < 1e-4
