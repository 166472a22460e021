"""Write tiny random MoE checkpoints (Qwen3.5-MoE, Qwen3-Next) in the layouts the releases ship
(spec/qwen3_5.md §1.1–1.2, §2.3–2.5, §9), and convert per-expert checkpoints to the fused layout.

Plain NumPy, like tools/make_checkpoint.py (whose tensor helpers it reuses), so CI needs no torch.

    python tools/make_moe_checkpoint.py OUT [--arch qwen3_5_moe|qwen3_next] [--layout vlm|causal]
        [--experts fused|per_expert] [--fp8] [--num-experts 5] [--num-experts-per-tok 3] ...
    python tools/make_moe_checkpoint.py OUT --fuse-from PER_EXPERT_CKPT   # the same weights, fused experts
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.checkpoint import Checkpoint  # noqa: E402
from tandem.dtypes import f32_to_bf16  # noqa: E402
from tandem.safetensors_io import Tensor, save_safetensors  # noqa: E402
from tools.make_checkpoint import _configs, _init, _layer_shapes, quantize_fp8_block, write_sharded  # noqa: E402

Shapes = dict[str, tuple[tuple[int, ...], str]]
ARCHS = ("qwen3_5_moe", "qwen3_next")
# modules stored FP8 in the FP8 releases (spec §9): attention, GDN q/k/v/z/out, dense MLPs, every expert
_FP8 = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz?|in_proj_z|out_proj)|"
                  r"mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj)$")
_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def _moe_shapes(c: dict[str, Any]) -> Shapes:
    d, n, i, s = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    out: Shapes = {"mlp.gate.weight": ((n, d), "proj"), "mlp.shared_expert.gate_proj.weight": ((s, d), "proj"),
                   "mlp.shared_expert.up_proj.weight": ((s, d), "proj"),
                   "mlp.shared_expert.down_proj.weight": ((d, s), "proj"),
                   "mlp.shared_expert_gate.weight": ((1, d), "proj")}
    if c["experts"] == "fused":
        out.update({"mlp.experts.gate_up_proj": ((n, 2 * i, d), "proj"), "mlp.experts.down_proj": ((n, d, i), "proj")})
    else:
        for e in range(n):
            out.update({f"mlp.experts.{e}.gate_proj.weight": ((i, d), "proj"),
                        f"mlp.experts.{e}.up_proj.weight": ((i, d), "proj"),
                        f"mlp.experts.{e}.down_proj.weight": ((d, i), "proj")})
    return out


def _layer(c: dict[str, Any], full: bool, sparse: bool) -> Shapes:
    s = _layer_shapes(c, full)
    if sparse:
        s = {k: v for k, v in s.items() if not k.startswith("mlp.")} | _moe_shapes(c)
    if c["arch"] == "qwen3_next" and not full:
        d, qkv = c["hidden_size"], s.pop("linear_attn.in_proj_qkv.weight")[0][0]
        z, hv = s.pop("linear_attn.in_proj_z.weight")[0][0], s.pop("linear_attn.in_proj_b.weight")[0][0]
        s.pop("linear_attn.in_proj_a.weight")
        s.update({"linear_attn.in_proj_qkvz.weight": ((qkv + z, d), "proj"),
                  "linear_attn.in_proj_ba.weight": ((2 * hv, d), "proj")})
    return s


def _sparse(c: dict[str, Any]) -> list[bool]:
    return [i not in c["mlp_only_layers"] and (i + 1) % c["decoder_sparse_step"] == 0
            for i in range(c["num_hidden_layers"])]


def _shapes(c: dict[str, Any]) -> Shapes:
    d, v = c["hidden_size"], c["vocab_size"]
    lm = "model.language_model." if c["layout"] == "vlm" else "model."
    shapes: Shapes = {f"{lm}embed_tokens.weight": ((v, d), "embed")}
    for i, sparse in enumerate(_sparse(c)):
        full = (i + 1) % c["full_attention_interval"] == 0
        shapes.update({f"{lm}layers.{i}.{k}": s for k, s in _layer(c, full, sparse).items()})
    shapes[f"{lm}norm.weight"] = ((d,), "norm")
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = ((v, d), "lm_head")
    if c["layout"] == "vlm":
        shapes.update({"model.visual.patch_embed.proj.weight": ((32, 3, 2, 4, 4), "proj"),
                       "model.visual.blocks.0.attn.qkv.weight": ((96, 32), "proj"),
                       "model.visual.merger.linear_fc2.weight": ((d, 128), "proj")})
    if c["with_mtp"]:
        shapes.update({"mtp.pre_fc_norm_embedding.weight": ((d,), "norm"),
                       "mtp.pre_fc_norm_hidden.weight": ((d,), "norm"), "mtp.fc.weight": ((d, 2 * d), "proj")})
        shapes.update({f"mtp.layers.0.{k}": s for k, s in _layer(c, True, True).items()})
        shapes["mtp.norm.weight"] = ((d,), "norm")
    return shapes


def _config(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    dense, gen = _configs(c, False, "BF16")
    text = dict(dense["text_config"])
    moe = {k: c[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "shared_expert_intermediate_size")}
    text.update(moe, router_aux_loss_coef=0.001)
    if c["arch"] == "qwen3_next":
        text.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                    decoder_sparse_step=c["decoder_sparse_step"], mlp_only_layers=c["mlp_only_layers"],
                    norm_topk_prob=c["norm_topk_prob"], transformers_version="5.24.0",
                    rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"],
                                     "partial_rotary_factor": c["partial_rotary_factor"]})
        for key in ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "mamba_ssm_dtype", "output_gate_type"):
            text.pop(key, None)
        config = text
    else:
        text.pop("intermediate_size")
        text["model_type"] = "qwen3_5_moe_text"
        if c["layout"] == "causal":
            config = {"architectures": ["Qwen3_5MoeForCausalLM"], **text, "transformers_version": "5.24.0"}
        else:
            config = {**dense, "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                      "text_config": text, "vision_config": {**dense["vision_config"],
                                                             "model_type": "qwen3_5_moe_vision"}}
    if c["fp8"]:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128],
                                         "modules_to_not_convert": ["lm_head", "*embed_tokens", "model.visual",
                                                                    "mtp.fc", "*mlp.gate", "*shared_expert_gate",
                                                                    "*in_proj_a", "*in_proj_b", "*in_proj_ba"]}
    return config, gen


def write_moe_checkpoint(path: str | Path, *, arch: str = "qwen3_5_moe", layout: str = "vlm",
                         experts: str = "fused", num_experts: int = 5, num_experts_per_tok: int = 3,
                         moe_intermediate_size: int = 32, shared_expert_intermediate_size: int = 48,
                         decoder_sparse_step: int = 1, mlp_only_layers: tuple[int, ...] = (),
                         norm_topk_prob: bool = True, hidden_size: int = 64, num_hidden_layers: int = 4,
                         intermediate_size: int = 96, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                         head_dim: int = 32, linear_num_key_heads: int = 2, linear_num_value_heads: int = 4,
                         linear_key_head_dim: int = 16, linear_value_head_dim: int = 16,
                         linear_conv_kernel_dim: int = 4, vocab_size: int = 512, tie_word_embeddings: bool = False,
                         full_attention_interval: int = 4, rope_theta: float = 10000.0,
                         partial_rotary_factor: float = 0.25, max_position_embeddings: int = 4096,
                         num_shards: int = 1, with_mtp: bool = True, fp8: bool = False, seed: int = 0,
                         init_std: float = 0.1, embed_std: float = 1.0, lm_head_std: float = 0.5) -> Path:
    """Write a random MoE checkpoint (config.json, generation_config.json, safetensors).

    ``arch`` qwen3_5_moe (``layout`` "vlm": ``Qwen3_5MoeForConditionalGeneration`` with nested text_config, a
    vision tower and ``model.language_model.*``; "causal": ``Qwen3_5MoeForCausalLM``, flat, ``model.*``; every
    layer sparse) or qwen3_next (flat, ``model.*``, fused GDN projections, ``decoder_sparse_step`` /
    ``mlp_only_layers`` / ``norm_topk_prob``). ``experts`` "fused" (3-D gate_up_proj / down_proj) or
    "per_expert". All tensors BF16 except A_log and the GDN norm (F32); with ``fp8`` (per-expert only) the
    linears the FP8 releases quantise are F8_E4M3 + BF16 ``weight_scale_inv``.
    Returns the directory. Raises ValueError for an unknown arch / layout / experts value or fused FP8.
    """
    c = dict(locals())
    c["mlp_only_layers"] = [int(i) for i in mlp_only_layers]
    if arch not in ARCHS or layout not in ("vlm", "causal") or experts not in ("fused", "per_expert"):
        raise ValueError(f"bad arch/layout/experts: {arch!r}, {layout!r}, {experts!r}")
    if arch == "qwen3_next":
        c["layout"] = "causal"
    else:
        c.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if fp8 and experts == "fused":
        raise ValueError("FP8 checkpoints store experts per expert (spec §13.8); use experts='per_expert'")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config, gen = _config(c)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    rng = np.random.default_rng(seed)
    tensors: dict[str, Tensor] = {}
    for name, (shape, kind) in _shapes(c).items():
        w = _init(rng, shape, kind, c).astype(np.float32)
        module = name.removesuffix(".weight")
        if fp8 and name.endswith(".weight") and _FP8.search(module) and not name.startswith("model.visual."):
            tensors[name], tensors[f"{module}.weight_scale_inv"] = quantize_fp8_block(w, "BF16")
        elif kind in ("A_log", "gated_norm"):
            tensors[name] = ("F32", w)
        else:
            tensors[name] = ("BF16", f32_to_bf16(w))
    write_sharded(out, tensors, num_shards)
    return out


def fuse_experts(src: str | Path, dst: str | Path) -> Path:
    """Write ``src`` with every per-expert float layer fused: ``experts.gate_up_proj`` [E, 2I, E_h] (gate rows
    then up rows of each expert) and ``experts.down_proj`` [E, E_h, I], the stored bits and dtype unchanged.

    Other tensors and files are copied as they are. Single ``model.safetensors``. Returns ``dst``.
    Raises ValueError when an expert is quantised (scales present) or experts of one layer differ in dtype.
    """
    ckpt, out = Checkpoint.open(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    for f in ckpt.root.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    tensors: dict[str, Tensor] = {}
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for name in ckpt.names():
        m = _EXPERT.match(name)
        if m is None:
            if re.search(r"\.experts\.\d+\.", name):
                raise ValueError(f"{name}: only unquantised experts can be fused")
            tensors[name] = (ckpt.dtype(name), np.array(ckpt.raw(name)))
            continue
        groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = name
    for prefix, by_expert in groups.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        dtypes = {ckpt.dtype(n) for parts in order for n in parts.values()}
        if len(dtypes) != 1:
            raise ValueError(f"{prefix}: experts of several dtypes {sorted(dtypes)}")
        dtype = dtypes.pop()
        tensors[prefix + "gate_up_proj"] = (dtype, np.stack([np.concatenate(
            [np.asarray(ckpt.raw(p["gate"])), np.asarray(ckpt.raw(p["up"]))]) for p in order]))
        tensors[prefix + "down_proj"] = (dtype, np.stack([np.asarray(ckpt.raw(p["down"])) for p in order]))
    save_safetensors(out / "model.safetensors", tensors)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--fuse-from", help="write the fused-experts twin of this per-expert checkpoint instead")
    p.add_argument("--arch", choices=ARCHS, default=None)
    p.add_argument("--layout", choices=["vlm", "causal"], default=None)
    p.add_argument("--experts", choices=["fused", "per_expert"], default=None)
    p.add_argument("--fp8", action="store_true", default=None)
    p.add_argument("--no-mtp", dest="with_mtp", action="store_false", default=None)
    p.add_argument("--mlp-only-layers", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=None)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "decoder_sparse_step", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_shards", "seed",
                  "full_attention_interval"):
        p.add_argument("--" + field.replace("_", "-"), dest=field, type=int, default=None)
    args = vars(p.parse_args(argv))
    out, src = args.pop("out"), args.pop("fuse_from")
    if src:
        print(fuse_experts(src, out))
        return
    print(write_moe_checkpoint(out, **{k: v for k, v in args.items() if v is not None}))


if __name__ == "__main__":
    main()
