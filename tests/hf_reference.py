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
