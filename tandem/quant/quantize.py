"""Quantise a BF16 or FP8 checkpoint to NVFP4 (ModelOpt layout) or FP8 (128×128 blocks), module by module.

Which modules: the projections of the chosen targets (mlp: gate/up/down; gdn: in_proj_qkv, in_proj_z, out_proj;
attn: q/k/v/o; experts: the MoE routed experts' and the shared expert's gate/up/down, never the router or the
shared-expert gate; fused 3-D experts are written per expert, tandem/quant/experts.py), minus `--keep` patterns; optionally the head as per-row FP8. Never: embeddings, norms, conv,
`in_proj_a/b`, `A_log`, `dt_bias`, the vision tower, `mtp.*` (spec §9, §10.1: these stay BF16/F32 in the
releases). Every other tensor is copied with its bits. The result loads back through `load_linear` by tensor
names, and config.json gains the `quantization_config` a ModelOpt or Qwen FP8 loader expects.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem.checkpoint import Checkpoint
from tandem.formats.load import load_linear
from tandem.formats.nvfp4 import NVFP4_GROUP, is_nvfp4
from tandem.quant.experts import fused_expert_modules, slice_bits, slice_f32
from tandem.quant.search import (DEFAULT_CLIPS, Quantized, quantize_fp8_block_searched,
                                 quantize_fp8_rows_searched, quantize_nvfp4_searched)
from tandem.safetensors_io import Tensor, write_checkpoint_files

TARGETS: dict[str, tuple[str, ...]] = {
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "gdn": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
            "linear_attn.in_proj_qkvz"),  # the last: Qwen3-Next's fused q/k/v/z (spec §2.5)
    "attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "experts": ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.*.down_proj",
                "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"),
}
FORMATS = ("nvfp4", "fp8")
# Tensor-name suffixes that belong to one quantised linear module (spec §9, §10.1, §10.2).
MODULE_SUFFIXES = ("weight", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale", "weight_packed",
                   "weight_global_scale", "input_global_scale")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "hf_quant_config.json"}


@dataclass
class QuantizeReport:
    """What `quantize_checkpoint` did: modules quantised / kept, errors and bytes per decode step."""

    fmt: str
    calibrated: bool
    quantized: dict[str, Quantized] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)  # module -> why it was left as it is
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> str:
        """A few lines: counts, weighted error vs round-to-nearest, bytes per step before and after."""
        rtn = sum(q.err_rtn for q in self.quantized.values())
        err = sum(q.err for q in self.quantized.values())
        groups = sum(q.num_groups for q in self.quantized.values())
        clip = sum(q.mean_clip * q.num_groups for q in self.quantized.values()) / max(groups, 1)
        lines = [f"quantised {len(self.quantized)} modules to {self.fmt} "
                 f"({'clip search on calibration activations' if self.calibrated else 'round to nearest'}); "
                 f"kept {len(self.kept)} as they were",
                 f"{'activation-weighted' if self.calibrated else 'unweighted'} squared error: {err:.6g} "
                 f"(round to nearest: {rtn:.6g}); mean clip {clip:.4f}",
                 f"bytes per decode step: {self.bytes_before:,} -> {self.bytes_after:,} "
                 f"({self.bytes_after / max(self.bytes_before, 1):.3f}x)"]
        for name, why in sorted(self.kept.items()):
            if why != "not a target":
                lines.append(f"  kept {name}: {why}")
        return "\n".join(lines)


def bytes_per_step(ckpt: Checkpoint) -> int:
    """Bytes of stored weights one decode step reads: every text tensor once, one embedding row, and the whole
    embedding again when the head is tied (no `lm_head.*`). Vision and `mtp.*` are not counted."""
    total = 0
    embed = [n for n in ckpt.text_names() if n.endswith("embed_tokens.weight")]
    for name in ckpt.text_names():
        info = ckpt.info(name)
        nbytes = info.end - info.begin
        total += nbytes // max(info.shape[0], 1) if name in embed else nbytes
    if not any(n.startswith("lm_head.") for n in ckpt.names()):
        total += sum(ckpt.info(n).end - ckpt.info(n).begin for n in embed)
    return total


def _modules(names: Sequence[str]) -> dict[str, list[str]]:
    """Module prefix -> its tensor names, for names ending in one of MODULE_SUFFIXES."""
    out: dict[str, list[str]] = {}
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if suffix in MODULE_SUFFIXES and prefix:
            out.setdefault(prefix, []).append(name)
    return out


def select_modules(ckpt: Checkpoint, targets: Sequence[str], keep: Sequence[str], head: bool
                   ) -> tuple[list[str], dict[str, str]]:
    """Modules to quantise and modules left as they are (with the reason), in checkpoint order.

    Raises: ValueError for an unknown target.
    """
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"unknown target(s) {bad}; choose from {sorted(TARGETS)}")
    suffixes = tuple(s for t in targets for s in TARGETS[t])
    chosen: list[str] = []
    kept: dict[str, str] = {}
    for module in [*_modules(ckpt.text_names()), *fused_expert_modules(ckpt)]:
        is_head = module == "lm_head"
        if not (any(fnmatch.fnmatchcase(module, "*" + s) for s in suffixes) or (head and is_head)):
            kept[module] = "not a target"
        elif any(fnmatch.fnmatchcase(module, p) for p in keep):
            kept[module] = "matches --keep"
        else:
            chosen.append(module)
    return chosen, kept


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str = "nvfp4",
                        targets: Sequence[str] = ("mlp", "gdn", "attn"), keep: Sequence[str] = (),
                        head_fp8: bool = False, act: dict[str, np.ndarray] | None = None,
                        clips: Sequence[float] = DEFAULT_CLIPS,
                        progress: Callable[[Sequence[str]], Any] | None = None) -> QuantizeReport:
    """Quantise the checkpoint at `src` into the directory `dst`.

    Args:
        fmt: "nvfp4" (ModelOpt NVFP4, 16-value E4M3 block scales) or "fp8" (128×128 blocks, F32 scales).
        targets: subset of TARGETS. keep: fnmatch patterns of module prefixes to leave as they are.
        head_fp8: quantise `lm_head` to FP8 with per-row scales (untied heads only).
        act: per-module input mean squares (`tandem.quant.calib`); None = round to nearest (clip 1).
        clips: candidate multipliers of the group maximum for the search (ignored without `act`).
        progress: wraps the module list for a progress bar (e.g. tqdm).
    Returns:
        QuantizeReport. Raises ValueError (bad fmt/target, src == dst), CheckpointError/ConfigError.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    src_dir, out = Path(src), Path(dst)
    if out.resolve() == src_dir.resolve():
        raise ValueError("the destination must differ from the source")
    ckpt = Checkpoint.open(src_dir)
    modules = _modules(ckpt.names())
    chosen, kept = select_modules(ckpt, targets, keep, head_fp8)
    fused = fused_expert_modules(ckpt)
    report = QuantizeReport(fmt, act is not None, kept=kept)
    done: dict[str, dict[str, Tensor]] = {}
    for module in (progress(chosen) if progress is not None else chosen):
        if module in fused:
            in_dim = ckpt.shape(fused[module].tensor)[2]
            why = f"in = {in_dim} is not a multiple of {NVFP4_GROUP} (NVFP4 blocks)" if (
                fmt == "nvfp4" and in_dim % NVFP4_GROUP) else ""
        else:
            why = _cannot_quantize(ckpt, module, fmt, head_fp8 and module == "lm_head")
        if why:
            report.kept[module] = why
            continue
        if module in fused:
            w = slice_f32(ckpt, fused[module])
        else:
            w = np.ascontiguousarray(getattr(load_linear(ckpt, module), "weight"), dtype=np.float32)
        a = act.get(module) if act is not None else None
        search = clips if a is not None else (1.0,)
        if module == "lm_head":
            q = quantize_fp8_rows_searched(w, a, search)
        elif fmt == "nvfp4":
            q = quantize_nvfp4_searched(w, a, search)
        else:
            q = quantize_fp8_block_searched(w, a, search)
        report.quantized[module] = q
        done[module] = {f"{module}.{k}": v for k, v in q.tensors.items()}
    unfused = {s.tensor for m, s in fused.items() if m in report.quantized}
    tensors: dict[str, Tensor] = {}
    for name in ckpt.names():
        module = name.rpartition(".")[0]
        if name in unfused:  # the layer's experts are written per expert
            for m, s in fused.items():
                if s.tensor == name:
                    tensors.update(done.pop(m) if m in done else {f"{m}.weight": slice_bits(ckpt, s)})
        elif module in done and name in modules.get(module, ()):
            tensors.update(done.pop(module))
        elif module not in report.quantized:
            tensors[name] = (ckpt.dtype(name), np.asarray(ckpt.raw(name)))
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint_files(out, tensors)
    _write_configs(src_dir, out, fmt, report, ckpt)
    report.bytes_before, report.bytes_after = bytes_per_step(ckpt), bytes_per_step(Checkpoint.open(out))
    return report


def _cannot_quantize(ckpt: Checkpoint, module: str, fmt: str, head: bool) -> str:
    """Why `module` stays as it is ("" when it can be quantised)."""
    if is_nvfp4(ckpt, module):
        return "already NVFP4"
    if not ckpt.has(f"{module}.weight") or len(ckpt.shape(f"{module}.weight")) != 2:
        return "no 2-D weight"
    if fmt == "fp8" and not head and ckpt.has(f"{module}.weight_scale_inv"):
        return "already FP8 block-scaled"
    in_dim = ckpt.shape(f"{module}.weight")[1]
    if fmt == "nvfp4" and not head and in_dim % NVFP4_GROUP:
        return f"in = {in_dim} is not a multiple of {NVFP4_GROUP} (NVFP4 blocks)"
    return ""


def _write_configs(src: Path, out: Path, fmt: str, report: QuantizeReport, ckpt: Checkpoint) -> None:
    """Copy config.json (+ quantization_config), hf_quant_config.json for NVFP4, and every other non-weight
    file of `src` (tokenizer, chat template, generation config, held-out prompts)."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in _SKIP_FILES:
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    quantized = set(report.quantized)
    excluded = sorted({m for m in _modules(ckpt.names()) if m not in quantized and not _stored_quantized(ckpt, m)}
                      | {n.rsplit(".", 1)[0] for n in ckpt.names() if n.endswith("embed_tokens.weight")}
                      | {"model.visual*", "mtp*"})
    if fmt == "fp8":
        qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128], "modules_to_not_convert": excluded}
    else:
        algos = {m: {"quant_algo": "NVFP4", "group_size": NVFP4_GROUP} if m != "lm_head" else {"quant_algo": "FP8"}
                 for m in sorted(quantized)}
        mixed = any(a["quant_algo"] != "NVFP4" for a in algos.values()) or any(
            _stored_quantized(ckpt, m) for m in report.kept if not is_nvfp4(ckpt, m))
        qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION" if mixed else "NVFP4",
              "group_size": NVFP4_GROUP, "kv_cache_quant_algo": None, "exclude_modules": excluded,
              "producer": {"name": "tandem"}}
        if mixed:
            qc["quantized_layers"] = algos
        hf = {"producer": {"name": "tandem"}, "quantization": {k: qc[k] for k in (
            "quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules")}}
        (out / "hf_quant_config.json").write_text(json.dumps(hf, indent=2))
    config["quantization_config"] = qc
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _stored_quantized(ckpt: Checkpoint, module: str) -> bool:
    return any(ckpt.has(f"{module}.{s}") for s in ("weight_scale_inv", "weight_scale", "weight_scale_2",
                                                    "weight_packed"))
