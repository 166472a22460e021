"""The quantiser: module selection, formats, clip search, calibration, configs, bytes per step, CLI
(tandem/quant/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem.checkpoint import Checkpoint
from tandem.cli import main
from tandem.formats import DenseLinear, FP8BlockLinear, FP8ScaledLinear, NVFP4Linear, load_linear
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.quant import activation_mean_squares, bytes_per_step, quantize_checkpoint
from tandem.quant.search import (quantize_fp8_block_searched, quantize_fp8_rows_searched,
                                 quantize_nvfp4_searched)
from tools.make_checkpoint import write_checkpoint

LP = "model.language_model.layers."
IDS = [5, 17, 3, 99, 256, 7, 7, 42, 511, 0, 13, 8]


def _logits(path: Path) -> np.ndarray:
    m = Qwen3_5Model.load(path)
    out: np.ndarray = m.prefill(m.new_state(len(IDS)), IDS, all_logits=True)
    return out


def test_nvfp4_mlp_only(tiny_ckpt: Path, tmp_path: Path) -> None:
    rep = quantize_checkpoint(tiny_ckpt, tmp_path / "q", "nvfp4", targets=["mlp"])
    ck = Checkpoint.open(tmp_path / "q")
    for i in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            p = f"{LP}{i}.mlp.{proj}"
            assert ck.dtype(p + ".weight") == "U8" and ck.dtype(p + ".weight_scale") == "F8_E4M3"
            assert ck.shape(p + ".weight_scale_2") == () and isinstance(load_linear(ck, p), NVFP4Linear)
    assert type(load_linear(ck, f"{LP}0.linear_attn.in_proj_qkv")) is DenseLinear
    assert ck.has("mtp.fc.weight") and ck.has("model.visual.blocks.0.attn.qkv.weight")
    assert len(rep.quantized) == 12 and set(rep.kept.values()) == {"not a target"}
    # bytes per step: each MLP matrix drops from 2 bytes a weight (BF16) to 0.5625 + 4 bytes of tensor scale
    mlp = 4 * 3 * 64 * 128
    assert rep.bytes_before == bytes_per_step(Checkpoint.open(tiny_ckpt))
    assert rep.bytes_before - rep.bytes_after == int(mlp * (2 - 0.5625)) - 12 * 4
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "NVFP4" and cfg["group_size"] == 16
    assert "lm_head" in cfg["exclude_modules"] and f"{LP}0.linear_attn.in_proj_a" in cfg["exclude_modules"]
    hf = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "NVFP4" and "kv_cache_quant_algo" in hf
    a, b = _logits(tiny_ckpt), _logits(tmp_path / "q")
    assert (a.argmax(1) == b.argmax(1)).mean() > 0.7 and np.abs(a - b).max() < 0.2 * np.abs(a).max()


def test_all_targets_head_fp8_and_keep(tiny_ckpt: Path, tmp_path: Path) -> None:
    rep = quantize_checkpoint(tiny_ckpt, tmp_path / "q", "nvfp4", keep=["*.layers.1.*"], head_fp8=True)
    ck = Checkpoint.open(tmp_path / "q")
    assert isinstance(load_linear(ck, f"{LP}3.self_attn.q_proj"), NVFP4Linear)
    assert isinstance(load_linear(ck, f"{LP}0.linear_attn.out_proj"), NVFP4Linear)
    assert type(load_linear(ck, f"{LP}1.mlp.up_proj")) is DenseLinear and rep.kept[f"{LP}1.mlp.up_proj"]
    assert type(load_linear(ck, f"{LP}0.linear_attn.in_proj_b")) is DenseLinear
    head = load_linear(ck, "lm_head")
    assert isinstance(head, FP8ScaledLinear) and ck.shape("lm_head.weight_scale") == (512, 1)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_algo"] == "MIXED_PRECISION" and cfg["quantized_layers"]["lm_head"] == {"quant_algo": "FP8"}
    assert ck.dtype(f"{LP}0.linear_attn.A_log") == "F32" and ck.dtype(f"{LP}0.linear_attn.conv1d.weight") == "BF16"
    Qwen3_5Model.load(tmp_path / "q")


def test_fp8_format_and_fp8_source(tiny_ckpt: Path, tiny_ckpt_fp8: Path, tmp_path: Path) -> None:
    quantize_checkpoint(tiny_ckpt, tmp_path / "f8", "fp8", targets=["mlp", "attn"])
    ck = Checkpoint.open(tmp_path / "f8")
    lin = load_linear(ck, f"{LP}2.mlp.down_proj")
    assert isinstance(lin, FP8BlockLinear) and ck.dtype(f"{LP}2.mlp.down_proj.weight_scale_inv") == "F32"
    assert json.loads((tmp_path / "f8" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    # FP8 source -> NVFP4 (dequantised, then quantised); untargeted FP8 modules keep their bits.
    rep = quantize_checkpoint(tiny_ckpt_fp8, tmp_path / "nv", "nvfp4", targets=["mlp"])
    ck2, src = Checkpoint.open(tmp_path / "nv"), Checkpoint.open(tiny_ckpt_fp8)
    assert isinstance(load_linear(ck2, f"{LP}0.mlp.up_proj"), NVFP4Linear)
    assert not ck2.has(f"{LP}0.mlp.up_proj.weight_scale_inv")
    name = f"{LP}0.linear_attn.in_proj_qkv.weight"
    assert np.array_equal(ck2.raw(name), src.raw(name)) and ck2.has(f"{LP}0.linear_attn.in_proj_qkv.weight_scale_inv")
    assert json.loads((tmp_path / "nv" / "config.json").read_text())["quantization_config"]["quant_algo"] == \
        "MIXED_PRECISION"
    assert rep.bytes_after < rep.bytes_before
    # Already NVFP4 / already FP8: left as they are.
    rep2 = quantize_checkpoint(tmp_path / "nv", tmp_path / "nv2", "nvfp4", targets=["mlp"])
    assert not rep2.quantized and rep2.kept[f"{LP}0.mlp.up_proj"] == "already NVFP4"
    Qwen3_5Model.load(tmp_path / "nv2")


def test_ragged_in_is_kept(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", hidden_size=72, num_hidden_layers=1, full_attention_interval=1,
                           num_shards=1, with_vision=False, with_mtp=False)
    rep = quantize_checkpoint(src, tmp_path / "q", "nvfp4", targets=["mlp"])
    assert "multiple of 16" in rep.kept[f"{LP}0.mlp.up_proj"]
    assert f"{LP}0.mlp.down_proj" in rep.quantized  # in = intermediate 128
    Qwen3_5Model.load(tmp_path / "q")


def test_clip_search_never_worse_than_rtn() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_t(3, (64, 128)) * 0.02).astype(np.float32)
    act = np.exp(rng.normal(0, 2, 128)).astype(np.float32)  # a few loud channels, as in real activations
    for fn in (quantize_nvfp4_searched, quantize_fp8_block_searched, quantize_fp8_rows_searched):
        q = fn(w, act, (1.0, 0.9, 0.8, 0.7))
        assert q.err <= q.err_rtn and q.mean_clip <= 1.0
        rtn = fn(w, act, (1.0,))
        assert rtn.err == rtn.err_rtn == q.err_rtn and rtn.mean_clip == 1.0
    nv = quantize_nvfp4_searched(w, act, (1.0, 0.9, 0.8, 0.7))
    assert nv.err < 0.97 * nv.err_rtn  # heavy tails: clipping pays


def test_calibration_records_every_linear_and_restores(tiny_ckpt: Path, tmp_path: Path) -> None:
    model = Qwen3_5Model.load(tiny_ckpt)
    before = model.weights.layers[0].mlp.up
    act = activation_mean_squares(model, IDS * 3)
    assert model.weights.layers[0].mlp.up is before and isinstance(model.head, DenseLinear)
    assert f"{LP}0.mlp.up_proj" in act and f"{LP}3.self_attn.o_proj" in act and "lm_head" in act
    assert act[f"{LP}0.mlp.down_proj"].shape == (128,) and np.all(act[f"{LP}0.mlp.up_proj"] > 0)
    rep = quantize_checkpoint(tiny_ckpt, tmp_path / "c", "nvfp4", targets=["mlp"], act=act)
    assert rep.calibrated and all(q.err <= q.err_rtn for q in rep.quantized.values())
    assert "clip search" in rep.summary() and "bytes per decode step" in rep.summary()


def test_cli_quantize(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(tiny_ckpt), str(tmp_path / "q"), "--format", "nvfp4", "--targets", "mlp,gdn",
                 "--keep", "*.layers.0.*", "--head", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "round to nearest" in out and "bytes per decode step" in out
    assert isinstance(load_linear(Checkpoint.open(tmp_path / "q"), f"{LP}2.linear_attn.in_proj_z"), NVFP4Linear)
    assert main(["quantize", str(tiny_ckpt), str(tmp_path / "x"), "--format", "nvfp4", "--targets", "moe"]) == 2
    assert "unknown target" in capsys.readouterr().err
    assert main(["quantize", str(tiny_ckpt), str(tmp_path / "y"), "--format", "fp8", "--calib",
                 str(tmp_path / "missing.txt")]) == 2
    assert main(["quantize", str(tiny_ckpt), str(tiny_ckpt), "--format", "fp8"]) == 2
