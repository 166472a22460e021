"""The embedded default model (tandem/assets/default): files, layout, size, and a transformers smoke load."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

ASSET = Path(__file__).resolve().parent.parent / "tandem" / "assets" / "default"
MAX_BYTES = 40_000_000


def _headers() -> dict[str, dict]:
    """name -> {dtype, shape, data_offsets} from every shard's safetensors header (no third-party reader)."""
    out: dict[str, dict] = {}
    for f in sorted(ASSET.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            hdr = json.loads(fh.read(n))
        hdr.pop("__metadata__", None)
        for k, v in hdr.items():
            assert k not in out, f"{k} in two shards"
            out[k] = dict(v, file=f.name)
    return out


def test_files_exist():
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
        "heldout_prompts.json",
        "README.md",
    ]:
        assert (ASSET / name).is_file(), name
    assert list(ASSET.glob("model-*-of-*.safetensors"))


def test_config_release_layout():
    cfg = json.loads((ASSET / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5"
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    tc = cfg["text_config"]
    assert tc["model_type"] == "qwen3_5_text"
    L = tc["num_hidden_layers"]
    assert tc["layer_types"] == ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)]
    assert tc["mtp_num_hidden_layers"] == 1
    assert tc["attn_output_gate"] is True
    rp = tc["rope_parameters"]
    assert sum(rp["mrope_section"]) == int(tc["head_dim"] * rp["partial_rotary_factor"]) // 2
    assert rp["mrope_interleaved"] is True
    tok = json.loads((ASSET / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in tok["added_tokens"]}
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]:
        assert s in vocab, s
    assert max(vocab.values()) < tc["vocab_size"]
    assert 8192 <= tc["vocab_size"] <= 16384
    gen = json.loads((ASSET / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    tcfg = json.loads((ASSET / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]


def test_weights_size_and_names():
    hdr = _headers()
    idx = json.loads((ASSET / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(hdr)
    assert all(idx["weight_map"][k] == v["file"] for k, v in hdr.items())
    total = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in hdr.values())
    assert total == idx["metadata"]["total_size"]
    assert total <= MAX_BYTES, total
    cfg = json.loads((ASSET / "config.json").read_text())["text_config"]
    prefixes = ("model.language_model.", "mtp.", "model.visual.")  # model.visual.*: the --vision fine-tune's tower
    assert all(k.startswith(prefixes) for k in hdr), [k for k in hdr if not k.startswith(prefixes)]
    assert "lm_head.weight" not in hdr and cfg["tie_word_embeddings"] is True
    assert hdr["model.language_model.embed_tokens.weight"]["shape"] == [cfg["vocab_size"], cfg["hidden_size"]]
    for i, lt in enumerate(cfg["layer_types"]):
        p = f"model.language_model.layers.{i}."
        if lt == "linear_attention":
            assert hdr[p + "linear_attn.A_log"]["dtype"] == "F32"
            assert hdr[p + "linear_attn.norm.weight"]["dtype"] == "F32"
            assert p + "linear_attn.in_proj_qkv.weight" in hdr
        else:
            D, H, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
            assert hdr[p + "self_attn.q_proj.weight"]["shape"] == [2 * H * hd, D]
    for n in ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"]:
        assert n in hdr, n
    assert hdr["mtp.fc.weight"]["shape"] == [cfg["hidden_size"], 2 * cfg["hidden_size"]]
    others = {v["dtype"] for k, v in hdr.items() if not k.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))}
    assert others == {"BF16"}


def test_heldout_prompts():
    prompts = json.loads((ASSET / "heldout_prompts.json").read_text())
    assert len(prompts) == 10
    assert all(isinstance(p, str) and 100 <= len(p) <= 300 for p in prompts)


def test_transformers_loads_and_generates():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("transformers without Qwen3.5")
    # float32: the bf16 weights widen exactly, and torch's bf16 CPU path took 90 s for these 16 tokens (fp32: 5 s)
    model, info = transformers.Qwen3_5ForCausalLM.from_pretrained(
        str(ASSET), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(str(ASSET))
    prompt = json.loads((ASSET / "heldout_prompts.json").read_text())[0]
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False, top_k=None, top_p=None, temperature=None)
    new = out[0, enc["input_ids"].shape[1]:]
    assert new.shape[0] == 16
    assert tok.decode(new).strip()
