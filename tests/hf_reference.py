"""The transformers reference model for parity tests (test-only; torch/transformers never enter tandem/).

What we found (transformers 5.24, torch 2.13 CPU): `Qwen3_5ForCausalLM.from_pretrained(path)` reads the nested
VLM config.json directly. The class's config is `Qwen3_5TextConfig`, whose `base_config_key = "text_config"`,
so `from_pretrained` takes `config["text_config"]` out of the top-level `qwen3_5` config by itself. The
checkpoint's `model.language_model.*` names are renamed to the causal LM's `model.*` by transformers' key
mapping, and `model.visual.*` / `mtp.*` are dropped silently (`_keys_to_ignore_on_load_unexpected`), so
`output_loading_info=True` reports no missing and no unexpected keys. F32 tensors (A_log, linear_attn.norm) load
as stored. Without fla / causal-conv1d, transformers uses its torch fallbacks (chunked delta rule for prefill,
recurrent form for one-token decode with a cache; spec §4.7–4.8) and may warn: fine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_hf_causal_lm(path: str | Path) -> Any:
    """Load a Qwen3.5 checkpoint directory (VLM layout or text-only) as a float32 `Qwen3_5ForCausalLM`, eval mode.

    Raises:
        AssertionError: if any language-model weight is missing or mis-shaped in the checkpoint.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], f"missing weights: {sorted(info['missing_keys'])}"
    assert not info["mismatched_keys"], f"mis-shaped weights: {info['mismatched_keys']}"
    model.eval()
    return model


DEFAULT_TOKENS = dict(vocab_size=12288, eos=12277, image=12280, video=12281, vision_start=12278, vision_end=12279)


def write_hf_vl_checkpoint(path: str | Path, seed: int = 0, depth: int = 2, linear_head_dim: int = 16) -> Path:
    """A tiny random Qwen3.5 vision-language checkpoint written by transformers (``Qwen3_5ForConditionalGeneration``
    ``save_pretrained``, float32), with the embedded default model's tokenizer, chat template and token ids, and a
    preprocessor_config.json (patch 8, merge 2, temporal 2, 1024..16384 pixels, mean = std = 0.5).

    Weights are re-drawn so that greedy margins are not tiny: text projections N(0, 0.1), embeddings N(0, 1),
    zero-centred norms N(0, 0.1), A_log log U(1, 16), conv N(0, 0.3); vision LayerNorm weights 1 + N(0, 0.2), every
    other vision tensor N(0, 0.2). Rotary: head_dim 64 × 0.25 = 16 dims, mrope_section [3, 3, 2].
    ``linear_head_dim``: the GDN key and value head dims (16; the CUDA GDN kernels take 32 and up).
    Returns: the directory.
    """
    import json
    import shutil

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    t = DEFAULT_TOKENS
    text = dict(vocab_size=t["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=linear_head_dim,
                linear_value_head_dim=linear_head_dim,
                max_position_embeddings=4096, eos_token_id=t["eos"], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    vision = dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=t["image"], video_token_id=t["video"],
                        vision_start_token_id=t["vision_start"], vision_end_token_id=t["vision_end"],
                        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if ".visual." in f".{name}":
                p.copy_(1 + 0.2 * r if "norm" in name and name.endswith("weight") else 0.2 * r)
            elif name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))
            elif "embed_tokens" in name:
                p.copy_(r)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif "conv1d" in name:
                p.copy_(0.3 * r)
            elif "dt_bias" in name:
                p.copy_(0.5 * r)
            else:
                p.copy_(0.1 * r)
    out = Path(path)
    model.save_pretrained(str(out))
    default = Path(__file__).resolve().parents[1] / "tandem" / "assets" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [t["eos"]]}))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 1024, "longest_edge": 16384}, "patch_size": 8, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return out


def load_hf_vl(path: str | Path) -> Any:
    """The checkpoint as a float32 ``Qwen3_5ForConditionalGeneration`` in eval mode."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_image_processor() -> Any:
    """transformers' PIL image processor with the parameters of ``write_hf_vl_checkpoint``'s preprocessor file."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 1024, "longest_edge": 16384},
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3)
