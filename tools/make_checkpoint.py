"""Write tiny random Qwen3.5 checkpoints in the exact layout of a real release (spec/qwen3_5.md §1, §2, §9).

Plain NumPy (its own safetensors writer: safetensors' NumPy API cannot record BF16 or F8_E4M3), so CI needs no
torch to make checkpoints.

    python tools/make_checkpoint.py OUT [--fp8] [--seed N] [--num-hidden-layers 4] ...
    python tools/make_checkpoint.py OUT --dequantize-from FP8_CKPT   # exact F32/BF16 twin of an FP8 checkpoint
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.checkpoint import Checkpoint  # noqa: E402
from tandem.dtypes import bf16_to_f32, e4m3_to_f32, f32_to_bf16, f32_to_e4m3  # noqa: E402
from tandem.formats.linear import dequantize_fp8_block  # noqa: E402
from tandem.safetensors_io import Tensor, save_safetensors  # noqa: E402

_ST_DTYPES = {"BF16": np.uint16, "F16": np.uint16, "F32": np.float32, "F8_E4M3": np.uint8, "U8": np.uint8}
FP8_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_sharded(out: Path, tensors: dict[str, Tensor], num_shards: int) -> None:
    """Write `model.safetensors` (num_shards == 1) or `model-0000i-of-0000N.safetensors` + index."""
    if num_shards <= 1:
        save_safetensors(out / "model.safetensors", tensors)
        return
    total = sum(a.nbytes for _, a in tensors.values())
    names = list(tensors)
    weight_map: dict[str, str] = {}
    shard_of, acc = [], 0
    for name in names:
        shard_of.append(min(num_shards - 1, acc * num_shards // max(total, 1)))
        acc += tensors[name][1].nbytes
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n, k in zip(names, shard_of) if k == s}
        save_safetensors(out / file, part)
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _mrope_section(rotary_dim: int) -> list[int]:
    """[11, 11, 10] for rotary dim 64, scaled: split rotary_dim/2 into 3 parts, earlier parts larger."""
    half = rotary_dim // 2
    return [half // 3 + (1 if i < half % 3 else 0) for i in range(3)]


def quantize_fp8_block(w: np.ndarray, scale_dtype: str) -> tuple[Tensor, Tensor]:
    """128×128 block FP8: S = amax/448 per block (stored in scale_dtype), Wq = e4m3(W / S). Spec §9."""
    out_dim, in_dim = w.shape
    grid = (-(-out_dim // 128), -(-in_dim // 128))
    pad = np.zeros((grid[0] * 128, grid[1] * 128), dtype=np.float32)
    pad[:out_dim, :in_dim] = w
    amax = np.abs(pad.reshape(grid[0], 128, grid[1], 128)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    if scale_dtype == "BF16":
        scale_bits = f32_to_bf16(scale)
        scale = bf16_to_f32(scale_bits)
        stored: Tensor = ("BF16", scale_bits)
    else:
        stored = ("F32", scale)
    expanded = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:out_dim, :in_dim]
    return ("F8_E4M3", f32_to_e4m3((w / expanded).astype(np.float32))), stored


def _configs(c: dict[str, Any], fp8: bool, scale_dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and generation_config.json for the hyper-parameters in `c` (spec §1.2, §11.4)."""
    n, v = c["num_hidden_layers"], c["vocab_size"]
    layer_types = ["full_attention" if (i + 1) % c["full_attention_interval"] == 0 else "linear_attention"
                   for i in range(n)]
    rotary_dim = int(c["head_dim"] * c["partial_rotary_factor"])
    text = {"model_type": "qwen3_5_text", **{k: c[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings",
        "full_attention_interval", "partial_rotary_factor", "tie_word_embeddings")},
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "layer_types": layer_types,
        "rope_parameters": {"rope_type": "default", "rope_theta": c["rope_theta"],
                            "partial_rotary_factor": c["partial_rotary_factor"],
                            "mrope_section": _mrope_section(rotary_dim), "mrope_interleaved": True},
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "output_gate_type": "swish",
        "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "initializer_range": c["init_std"], "use_cache": True, "bos_token_id": None, "eos_token_id": v - 1,
        "dtype": "bfloat16"}
    vision = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
              "num_heads": 2, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "out_hidden_size": c["hidden_size"], "num_position_embeddings": 16,
              "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.02}
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
        "vision_config": vision, "image_token_id": v - 6, "video_token_id": v - 5,
        "vision_start_token_id": v - 4, "vision_end_token_id": v - 3,
        "tie_word_embeddings": c["tie_word_embeddings"], "transformers_version": "5.24.0"}
    if fp8:
        gdn = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        skip = ["lm_head", "model.language_model.embed_tokens", "model.visual", "mtp.fc"]
        skip += [f"model.language_model.layers.{i}.linear_attn.in_proj_{ab}" for i in gdn for ab in "ab"]
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128], "modules_to_not_convert": skip}
    gen = {"bos_token_id": v - 1, "eos_token_id": [v - 2, v - 1], "pad_token_id": v - 1, "do_sample": True,
           "top_k": 20, "top_p": 0.95, "temperature": 0.6, "transformers_version": "5.24.0"}
    return config, gen


def _layer_shapes(c: dict[str, Any], full: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Per-layer tensor suffix -> (shape, init kind) for one decoder layer (spec §2.2)."""
    d, f = c["hidden_size"], c["intermediate_size"]
    s: dict[str, tuple[tuple[int, ...], str]] = {"input_layernorm.weight": ((d,), "norm")}
    if full:
        h, hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        s.update({"self_attn.q_proj.weight": ((2 * h * hd, d), "proj"),
                  "self_attn.k_proj.weight": ((hkv * hd, d), "proj"),
                  "self_attn.v_proj.weight": ((hkv * hd, d), "proj"),
                  "self_attn.o_proj.weight": ((d, h * hd), "proj"),
                  "self_attn.q_norm.weight": ((hd,), "norm"), "self_attn.k_norm.weight": ((hd,), "norm")})
    else:
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv, k = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
        conv_dim = 2 * hk * dk + hv * dv
        s.update({"linear_attn.in_proj_qkv.weight": ((conv_dim, d), "proj"),
                  "linear_attn.in_proj_z.weight": ((hv * dv, d), "proj"),
                  "linear_attn.in_proj_b.weight": ((hv, d), "proj"),
                  "linear_attn.in_proj_a.weight": ((hv, d), "proj"),
                  "linear_attn.conv1d.weight": ((conv_dim, 1, k), "conv"),
                  "linear_attn.dt_bias": ((hv,), "dt_bias"), "linear_attn.A_log": ((hv,), "A_log"),
                  "linear_attn.norm.weight": ((dv,), "gated_norm"),
                  "linear_attn.out_proj.weight": ((d, hv * dv), "proj")})
    s.update({"post_attention_layernorm.weight": ((d,), "norm"), "mlp.gate_proj.weight": ((f, d), "proj"),
              "mlp.up_proj.weight": ((f, d), "proj"), "mlp.down_proj.weight": ((d, f), "proj")})
    return s


def _all_shapes(c: dict[str, Any], with_vision: bool, with_mtp: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    d, v = c["hidden_size"], c["vocab_size"]
    lm = "model.language_model."
    shapes: dict[str, tuple[tuple[int, ...], str]] = {f"{lm}embed_tokens.weight": ((v, d), "embed")}
    for i in range(c["num_hidden_layers"]):
        full = (i + 1) % c["full_attention_interval"] == 0
        shapes.update({f"{lm}layers.{i}.{k}": s for k, s in _layer_shapes(c, full).items()})
    shapes[f"{lm}norm.weight"] = ((d,), "norm")
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = ((v, d), "lm_head")
    if with_vision:
        shapes.update({"model.visual.patch_embed.proj.weight": ((32, 3, 2, 4, 4), "proj"),
                       "model.visual.patch_embed.proj.bias": ((32,), "proj"),
                       "model.visual.pos_embed.weight": ((16, 32), "proj"),
                       "model.visual.blocks.0.norm1.weight": ((32,), "norm"),
                       "model.visual.blocks.0.attn.qkv.weight": ((96, 32), "proj"),
                       "model.visual.merger.linear_fc2.weight": ((d, 128), "proj")})
    if with_mtp:
        shapes.update({"mtp.pre_fc_norm_embedding.weight": ((d,), "norm"),
                       "mtp.pre_fc_norm_hidden.weight": ((d,), "norm"), "mtp.fc.weight": ((d, 2 * d), "proj")})
        shapes.update({f"mtp.layers.0.{k}": s for k, s in _layer_shapes(c, True).items()})
        shapes["mtp.norm.weight"] = ((d,), "norm")
    return shapes


def _init(rng: np.random.Generator, shape: tuple[int, ...], kind: str, c: dict[str, Any]) -> np.ndarray:
    if kind == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape))
    std = {"proj": c["init_std"], "embed": c["embed_std"], "lm_head": c["lm_head_std"], "norm": 0.1,
           "gated_norm": 0.1, "conv": 0.3, "dt_bias": 0.5}[kind]
    w = rng.normal(0.0, std, shape)
    return w + 1.0 if kind == "gated_norm" else w


def write_checkpoint(path: str | Path, *, hidden_size: int = 64, num_hidden_layers: int = 4,
                     intermediate_size: int = 128, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                     head_dim: int = 32, linear_num_key_heads: int = 2, linear_num_value_heads: int = 4,
                     linear_key_head_dim: int = 16, linear_value_head_dim: int = 16,
                     linear_conv_kernel_dim: int = 4, vocab_size: int = 512, tie_word_embeddings: bool = False,
                     full_attention_interval: int = 4, rope_theta: float = 10000.0,
                     partial_rotary_factor: float = 0.25, max_position_embeddings: int = 4096,
                     num_shards: int = 2, with_vision: bool = True, with_mtp: bool = True, fp8: bool = False,
                     scale_dtype: str = "BF16", seed: int = 0, init_std: float = 0.02,
                     embed_std: float = 1.0, lm_head_std: float = 0.5) -> Path:
    """Write a random Qwen3.5 VLM-layout checkpoint (config.json, generation_config.json, safetensors).

    All tensors BF16 except `linear_attn.A_log` and `linear_attn.norm.weight` (F32, as Qwen3.5 releases).
    With `fp8`, the linears of spec §9 are F8_E4M3 + `weight_scale_inv` ([ceil(out/128), ceil(in/128)],
    `scale_dtype` BF16 or F32) and config.json gets `quantization_config`.
    Returns the checkpoint directory. Raises ValueError for an unknown scale_dtype.
    """
    if scale_dtype not in ("BF16", "F32"):
        raise ValueError(f"scale_dtype must be 'BF16' or 'F32', got {scale_dtype!r}")
    c = dict(locals())
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config, gen = _configs(c, fp8, scale_dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    rng = np.random.default_rng(seed)
    tensors: dict[str, Tensor] = {}
    for name, (shape, kind) in _all_shapes(c, with_vision, with_mtp).items():
        w = _init(rng, shape, kind, c).astype(np.float32)
        module = name.removesuffix(".weight")
        if fp8 and module.endswith(FP8_SUFFIXES) and not name.startswith("model.visual."):
            tensors[name], tensors[f"{module}.weight_scale_inv"] = quantize_fp8_block(w, scale_dtype)
        elif kind in ("A_log", "gated_norm"):
            tensors[name] = ("F32", w)
        else:
            tensors[name] = ("BF16", f32_to_bf16(w))
    write_sharded(out, tensors, num_shards)
    return out


def dequantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write the exact float twin of an FP8 checkpoint: each FP8 linear becomes F32 W = f32(Wq)·f32(S).

    F32 because dequantized values need not be representable in BF16; every other tensor keeps its bits and
    dtype. Single `model.safetensors`; config.json loses `quantization_config`. Returns `dst`.
    """
    ckpt, out = Checkpoint.open(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((ckpt.root / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (ckpt.root / "generation_config.json").is_file():
        shutil.copy(ckpt.root / "generation_config.json", out / "generation_config.json")
    tensors: dict[str, Tensor] = {}
    for name in ckpt.names():
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        if name.endswith(".weight_scale_inv"):
            continue
        if name.endswith(".weight") and ckpt.has(scale_name):
            codes = e4m3_to_f32(np.asarray(ckpt.raw(name), dtype=np.uint8))
            tensors[name] = ("F32", dequantize_fp8_block(codes, ckpt.get(scale_name), name))
        else:
            tensors[name] = (ckpt.dtype(name), np.array(ckpt.raw(name)))
    save_safetensors(out / "model.safetensors", tensors)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: python tools/make_checkpoint.py OUT [--fp8] [--seed N] [--<field> VALUE ...]."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--dequantize-from", help="write the float twin of this FP8 checkpoint instead")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--no-vision", dest="with_vision", action="store_false")
    p.add_argument("--no-mtp", dest="with_mtp", action="store_false")
    p.add_argument("--scale-dtype", default="BF16", choices=["BF16", "F32"])
    for field in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "vocab_size", "num_shards", "seed",
                  "full_attention_interval", "max_position_embeddings"):
        p.add_argument("--" + field.replace("_", "-"), dest=field, type=int, default=None)
    for field in ("init_std", "embed_std", "lm_head_std", "rope_theta"):
        p.add_argument("--" + field.replace("_", "-"), dest=field, type=float, default=None)
    args = vars(p.parse_args(argv))
    out, src = args.pop("out"), args.pop("dequantize_from")
    if src:
        print(dequantize_checkpoint(src, out))
        return
    print(write_checkpoint(out, **{k: v for k, v in args.items() if v is not None}))


if __name__ == "__main__":
    main()
