"""Parity of the NumPy MoE adapters with transformers (torch CPU, fp32) on random checkpoints that transformers'
own classes write: ``Qwen3_5MoeForConditionalGeneration`` (release layout, nested text_config, vision tower),
``Qwen3_5MoeForCausalLM`` and ``Qwen3NextForCausalLM`` (flat; a dense ``mlp_only_layers`` layer, sparse step,
``norm_topk_prob`` off in one shape). transformers writes experts per expert; the fused-layout twin of each
checkpoint (tools/make_moe_checkpoint.py ``fuse_experts``) must give the same bits. Greedy tokens identical for
20 prompts x 64 new tokens; prefill logits within 1e-4 relative; the smallest top-1 margin is printed (-s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tools.make_moe_checkpoint import fuse_experts, write_moe_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NUM_PROMPTS, NEW_TOKENS = 20, 64
pytestmark = pytest.mark.slow
_TEXT = dict(vocab_size=384, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=12, moe_intermediate_size=24, shared_expert_intermediate_size=40,
             initializer_range=0.1, max_position_embeddings=1024)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_5_moe_vlm": dict(num_experts=8, num_experts_per_tok=2, seed=1),
    "qwen3_5_moe_causal": dict(num_experts=5, num_experts_per_tok=3, tie_word_embeddings=True, seed=2),
    "qwen3_next": dict(num_experts=6, num_experts_per_tok=3, intermediate_size=56, mlp_only_layers=[1],
                       decoder_sparse_step=1, norm_topk_prob=True, seed=3),
    "qwen3_next_step2_unnormed": dict(num_experts=7, num_experts_per_tok=2, intermediate_size=40,
                                      decoder_sparse_step=2, norm_topk_prob=False, seed=4),
}


def _hf_model(name: str) -> Any:
    """A random transformers model of shape ``name`` (weights scaled so logits have real margins), eval mode."""
    kw = dict(SHAPES[name])
    torch.manual_seed(kw.pop("seed"))
    text = {**_TEXT, **kw}
    if name == "qwen3_5_moe_vlm":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
        model = transformers.Qwen3_5MoeForConditionalGeneration(
            transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision))
    elif name.startswith("qwen3_5_moe"):
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**text))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.3 if text.get("tie_word_embeddings") else 1.0)
            elif pname.endswith("lm_head.weight") and not text.get("tie_word_embeddings"):
                p.normal_(0.0, 0.5)
            elif pname.endswith("norm.weight") and "linear_attn" not in pname:
                p.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def trio(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine, Any, str]:
    """(engine on transformers' per-expert checkpoint, engine on its fused twin, the transformers model, name)."""
    name = request.param
    hf = _hf_model(name)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(str(path))
    fused = fuse_experts(path, tmp_path_factory.mktemp(name + "_fused"))
    return (Engine.from_pretrained(path, max_context=512, kv_dtype="fp32"),
            Engine.from_pretrained(fused, max_context=512, kv_dtype="fp32"), hf, name)


def _prompts(vocab: int, seed: int, num: int = NUM_PROMPTS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, 100))).tolist() for _ in range(num)]


def _hf_logits(hf: Any, seq: list[int]) -> Any:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()


def test_checkpoint_layouts(trio: tuple[Engine, Engine, Any, str]) -> None:
    """transformers wrote the layout this test expects (per expert; VLM prefix and vision tower where named)."""
    engine, fused, _, name = trio
    assert engine.model.path is not None and fused.model.path is not None
    names = {p.name for p in engine.model.path.iterdir()}
    assert "config.json" in names
    from tandem.checkpoint import Checkpoint

    ck, fk = Checkpoint.open(engine.model.path), Checkpoint.open(fused.model.path)
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in ck.names())
    assert any(n.endswith(".mlp.experts.gate_up_proj") for n in fk.names())
    assert not any(".experts.0." in n for n in fk.names())
    assert any(n.startswith("model.visual.") for n in ck.names()) == (name == "qwen3_5_moe_vlm")


def test_prefill_logits_match(trio: tuple[Engine, Engine, Any, str]) -> None:
    engine, fused, hf, _ = trio
    for ids in _prompts(engine.vocab_size, 7, 4) + [list(range(1, 150))]:
        ours = engine.model.prefill(engine.model.new_state(len(ids)), ids, all_logits=True)
        twin = fused.model.prefill(fused.model.new_state(len(ids)), ids, all_logits=True)
        np.testing.assert_array_equal(ours, twin)
        ref = _hf_logits(hf, ids).numpy()
        rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
        assert rel < 1e-4, f"prefill logits differ: relative error {rel:.2e}"


def test_greedy_tokens_match(trio: tuple[Engine, Engine, Any, str]) -> None:
    engine, fused, hf, name = trio
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    margins = []
    for ids in _prompts(engine.vocab_size, 11):
        ours = engine.complete(ids, params).token_ids
        assert fused.complete(ids, params).token_ids == ours
        seq = ids + ours
        logits = _hf_logits(hf, seq)[len(ids) - 1:len(seq) - 1]
        ref = torch.argmax(logits, dim=-1).tolist()
        assert ours == ref, f"greedy tokens differ at index {next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)}"
        top = torch.topk(logits, 2, dim=-1).values
        margins.append(float((top[:, 0] - top[:, 1]).min()))
    print(f"\n[{name}] greedy parity on {NUM_PROMPTS} prompts x {NEW_TOKENS} tokens; "
          f"smallest top-1 margin {min(margins):.4g} logits")


def test_router_matches_transformers(trio: tuple[Engine, Engine, Any, str]) -> None:
    """The experts and weights our router picks equal transformers' router on the same layer inputs."""
    from tandem.models.qwen3_5_moe.moe import SparseMoE, route
    from tandem.models.qwen3_5_moe.weights import MoELayerWeights

    engine, _, hf, _ = trio
    layers = [lw for lw in engine.model.weights.layers if isinstance(lw, MoELayerWeights)
              and isinstance(lw.ffn, SparseMoE)]
    assert layers
    ffn = layers[0].ffn
    assert isinstance(ffn, SparseMoE)
    x = np.random.default_rng(5).normal(0, 1, (64, engine.model.hp.hidden_size)).astype(np.float32)
    top, w = route(ffn.router.matmul(x), ffn.top_k, ffn.norm_topk_prob)
    idx = next(i for i, lw in enumerate(engine.model.weights.layers) if lw is layers[0])
    block = next(m for n, m in hf.named_modules() if n.endswith(f"layers.{idx}.mlp"))
    with torch.no_grad():
        _, ref_w, ref_top = block.gate(torch.from_numpy(x))
    np.testing.assert_array_equal(top, ref_top.numpy())
    np.testing.assert_allclose(w, ref_w.numpy(), rtol=1e-5, atol=1e-7)


def test_fuse_refuses_quantised_experts(tmp_path: Path) -> None:
    """fuse_experts refuses quantised experts (they stay per expert in every release)."""
    src = write_moe_checkpoint(tmp_path / "fp8", experts="per_expert", fp8=True)
    with pytest.raises(ValueError, match="only unquantised experts"):
        fuse_experts(src, tmp_path / "out")


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_fused_release_layout_read_by_transformers(tmp_path: Path, arch: str) -> None:
    """A BF16 fused-experts checkpoint of our writer (the BF16 release layout; nested VLM config for
    qwen3_5_moe) loads into transformers with no missing or unexpected key, and its logits match ours."""
    path = write_moe_checkpoint(tmp_path / arch, arch=arch, mlp_only_layers=(2,) if arch == "qwen3_next" else ())
    cls = transformers.Qwen3_5MoeForCausalLM if arch == "qwen3_5_moe" else transformers.Qwen3NextForCausalLM
    hf, info = cls.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    engine = Engine.from_pretrained(path, kv_dtype="fp32")
    ids = list(range(3, 90))
    ours = engine.model.prefill(engine.model.new_state(len(ids)), ids, all_logits=True)
    ref = _hf_logits(hf.eval(), ids).numpy()
    assert float(np.abs(ours - ref).max() / np.abs(ref).max()) < 1e-4
