"""NVFP4 and FP8 scaled formats: exhaustive codecs, quantise/dequantise bounds, ModelOpt and compressed-tensors
loading (tandem/dtypes.py, tandem/formats/nvfp4.py; spec/qwen3_5.md §10)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.dtypes import (E2M1_TABLE, E4M3_TABLE, e2m1_to_f32, f32_to_bf16, f32_to_e2m1, f32_to_e4m3, pack_e2m1,
                           unpack_e2m1)
from tandem.formats import (DenseLinear, FP8ScaledLinear, Linear, NVFP4Linear, dequantize_nvfp4, load_linear,
                            quantize_nvfp4)
from tandem.formats.nvfp4 import nvfp4_fake_quant, nvfp4_global_scale, quantize_fp8_rows
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.safetensors_io import save_safetensors

LP = "model.language_model.layers."


# ------------------------------------------------------------------------------------------------- codecs
def test_e2m1_all_codes_decode_and_round_trip() -> None:
    codes = np.arange(16, dtype=np.uint8)
    values = e2m1_to_f32(codes)
    expected = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    assert np.array_equal(values[:8], expected) and np.array_equal(values[8:], -expected)
    assert np.array_equal(np.signbit(values), codes >= 8)
    assert np.array_equal(values.astype(ml_dtypes.float4_e2m1fn).astype(np.float32), values)
    assert np.array_equal(f32_to_e2m1(values), codes)  # every code survives decode -> encode, -0 included


def test_e2m1_encoder_thresholds_and_ml_dtypes() -> None:
    # spec §10.1 thresholds: ≤0.25→0, <0.75→0.5, ≤1.25→1, <1.75→1.5, ≤2.5→2, <3.5→3, ≤5→4, else 6
    cases = {0.25: 0, 0.2500001: 0.5, 0.75: 1, 0.7499999: 0.5, 1.25: 1, 1.75: 2, 2.5: 2, 3.5: 4, 5.0: 4,
             5.0000005: 6, 7.0: 6, 1e9: 6}
    for x, want in cases.items():
        for sgn in (1, -1):
            got = E2M1_TABLE[f32_to_e2m1(np.array([sgn * x], np.float32))][0]
            assert got == sgn * want, (sgn * x, got)
    grid = np.linspace(-7, 7, 280001, dtype=np.float32)
    mids = (E2M1_TABLE[:7] + E2M1_TABLE[1:8]) / 2
    grid = np.concatenate([grid, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 9)]).astype(np.float32)
    ref = grid.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(E2M1_TABLE[f32_to_e2m1(grid)], ref)
    with pytest.raises(ValueError, match="0..15"):
        e2m1_to_f32(np.array([16], np.uint8))


def test_e4m3_all_codes_decode_and_round_trip() -> None:
    codes = np.arange(256, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(E4M3_TABLE), nan) and set(codes[nan]) == {0x7F, 0xFF}
    assert np.array_equal(E4M3_TABLE[~nan], ref[~nan])
    assert np.array_equal(f32_to_e4m3(E4M3_TABLE[~nan]), codes[~nan])
    # Every midpoint between neighbouring finite codes (ties go to the even code), and just either side of it.
    pos = E4M3_TABLE[:127].astype(np.float64)
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    xs = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1000)])
    xs = np.concatenate([xs, -xs]).astype(np.float32)
    assert np.array_equal(f32_to_e4m3(xs), xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_pack_nibble_order() -> None:
    codes = np.array([[1, 2, 15, 0]], np.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x0F]]  # element 2c in the low nibble
    assert np.array_equal(unpack_e2m1(packed), codes)
    every = np.arange(256, dtype=np.uint8).reshape(4, 64)
    assert np.array_equal(pack_e2m1(unpack_e2m1(every)), every)


# ------------------------------------------------------------------------------------------------- quantiser
def _weights(rng: np.random.Generator, out_dim: int = 48, in_dim: int = 96) -> np.ndarray:
    row_scale = np.exp(rng.normal(0, 1.5, (out_dim, 1)))  # rows of very different size stress the block scales
    return (rng.standard_t(4, (out_dim, in_dim)) * 0.02 * row_scale).astype(np.float32)


def test_quantize_dequantize_within_bound() -> None:
    w = _weights(np.random.default_rng(0))
    packed, scale_codes, g = quantize_nvfp4(w)
    assert packed.shape == (48, 48) and scale_codes.shape == (48, 6) and g == np.float32(np.abs(w).max() / 2688)
    deq = dequantize_nvfp4(packed, scale_codes, float(g))
    amax = np.abs(w.reshape(48, 6, 16)).max(axis=2, keepdims=True)
    # E2M1 rounds to within one step at the top of the grid (gap 2 between 4 and 6: half-gap 1 in units of s·g),
    # and the E4M3 scale is within 2^-4 of amax/6/g; so |err| ≤ amax · (1 + 2^-4) / 6 per element.
    err = np.abs(w - deq).reshape(48, 6, 16)
    assert np.all(err <= amax * (17 / 16) / 6 + 1e-12)
    # Below 2·s·g (where the grid step is 0.5) the error is at most a quarter step: amax · (1 + 2^-4) / 24.
    small = np.abs(w.reshape(48, 6, 16)) < amax / 3
    assert np.all((err <= amax * (17 / 16) / 24 + 1e-12) | ~small)
    rel = np.linalg.norm(w - deq) / np.linalg.norm(w)
    assert rel < 0.12


def test_representable_weights_round_trip_exactly() -> None:
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (8, 64)).astype(np.uint8)
    codes[:, ::16] = 7  # every block holds a 6, so amax / 6 is the block scale itself
    scale_codes = f32_to_e4m3(np.exp2(rng.integers(-6, 8, (8, 4))).astype(np.float32))
    g = np.float32(2.0**-10)
    w = dequantize_nvfp4(pack_e2m1(codes), scale_codes, float(g))
    packed, sc, g2 = quantize_nvfp4(w, global_scale=float(g))
    assert np.array_equal(sc, scale_codes) and np.array_equal(dequantize_nvfp4(packed, sc, float(g2)), w)


def test_dequantize_matches_float64_reference() -> None:
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (5, 16)).astype(np.uint8)
    scale_codes = f32_to_e4m3(rng.uniform(0.01, 400, (5, 2)).astype(np.float32))
    g = 3.7e-4
    nib = np.stack([packed & 15, packed >> 4], axis=-1).reshape(5, 32)
    ref = (E2M1_TABLE[nib].astype(np.float64) * np.repeat(E4M3_TABLE[scale_codes].astype(np.float64), 16, axis=1)
           * np.float64(np.float32(g)))
    got = dequantize_nvfp4(packed, scale_codes, g)
    assert np.array_equal(got, ref.astype(np.float32))  # one rounding: the global multiply
    ct = dequantize_nvfp4(packed, scale_codes, 1 / g, divide=True)
    np.testing.assert_allclose(ct, ref, rtol=1e-6)


def test_quantize_rejects_ragged_in() -> None:
    with pytest.raises(ValueError, match=r"mlp\.up_proj.*multiple of 16.*\[4, 20\]"):
        quantize_nvfp4(np.ones((4, 20), np.float32), name="mlp.up_proj")
    with pytest.raises(CheckpointError, match=r"blk\.weight_scale.*\[4, 3\].*expected \[4, 2\]"):
        dequantize_nvfp4(np.zeros((4, 16), np.uint8), np.zeros((4, 3), np.uint8), 1.0, name="blk")


def test_clip_below_one_saturates_and_zero_blocks() -> None:
    w = np.zeros((2, 32), np.float32)
    w[0, :16] = np.linspace(-1, 1, 16)
    deq, codes, sc = nvfp4_fake_quant(w, 0.5, nvfp4_global_scale(w))
    assert np.all(deq[1] == 0) and np.all(codes[0, 16:] == 0) and deq[0, 0] < 0 and abs(deq[0, 0]) < 0.6
    assert np.all(np.isfinite(deq))


def test_nvfp4_linear_row_invariant_and_bytes() -> None:
    rng = np.random.default_rng(3)
    w = _weights(rng)
    lin = NVFP4Linear(*quantize_nvfp4(w), name="t")
    assert isinstance(lin, Linear) and lin.shape == (48, 96)
    assert lin.stored_bytes == 48 * 96 // 2 + 48 * 96 // 16 + 4  # 0.5625 bytes a weight + the tensor scale
    x = rng.normal(0, 1, (7, 96)).astype(np.float32)
    y = lin.matmul(x)
    for i in range(7):
        assert np.array_equal(y[i], lin.matmul(x[i:i + 1])[0])
    np.testing.assert_allclose(y, x.astype(np.float64) @ lin.weight.T.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_fp8_scaled_per_tensor_and_per_row() -> None:
    rng = np.random.default_rng(4)
    w = _weights(rng, 8, 32)
    codes, scale = quantize_fp8_rows(w)
    lin = FP8ScaledLinear(codes, scale, "head")
    assert np.array_equal(lin.weight, (E4M3_TABLE[codes].astype(np.float64) * scale).astype(np.float32))
    np.testing.assert_allclose(lin.weight, w, rtol=0.07, atol=1e-6)
    tensor = FP8ScaledLinear(codes, np.array(0.5, np.float32), "t")
    assert np.array_equal(tensor.weight, E4M3_TABLE[codes] * np.float32(0.5)) and tensor.stored_bytes == 8 * 32 + 4
    with pytest.raises(CheckpointError, match=r"t\.weight_scale.*\[3\]"):
        FP8ScaledLinear(codes, np.ones(3, np.float32), "t")


# ------------------------------------------------------------------------------------------------- checkpoints
def _modelopt_tensors(w: np.ndarray, prefix: str) -> dict[str, tuple[str, np.ndarray]]:
    packed, sc, g = quantize_nvfp4(w)
    return {f"{prefix}.weight": ("U8", packed), f"{prefix}.weight_scale": ("F8_E4M3", sc),
            f"{prefix}.weight_scale_2": ("F32", np.array(g, np.float32)),
            f"{prefix}.input_scale": ("F32", np.array(0.01, np.float32))}


def test_load_linear_modelopt_and_compressed_tensors(tmp_path: Path) -> None:
    w = _weights(np.random.default_rng(5), 16, 64)
    packed, sc, g = quantize_nvfp4(w)
    save_safetensors(tmp_path / "model.safetensors", {
        **_modelopt_tensors(w, "mo"),
        "ct.weight_packed": ("U8", packed), "ct.weight_scale": ("F8_E4M3", sc),
        "ct.weight_global_scale": ("F32", np.array([1 / g], np.float32)),  # a divisor (spec §10.2)
        "ct.input_global_scale": ("F32", np.array([100.0], np.float32)),
        "fp8.weight": ("F8_E4M3", f32_to_e4m3(w)), "fp8.weight_scale": ("F32", np.array(2.0, np.float32)),
        "bad.weight": ("BF16", f32_to_bf16(w)), "bad.weight_scale": ("F32", np.array(1.0, np.float32)),
        "plain.weight": ("BF16", f32_to_bf16(w))})
    ck = Checkpoint.open(tmp_path)
    mo, ct = load_linear(ck, "mo"), load_linear(ck, "ct")
    assert isinstance(mo, NVFP4Linear) and isinstance(ct, NVFP4Linear) and mo.shape == ct.shape == (16, 64)
    assert np.array_equal(mo.weight, dequantize_nvfp4(packed, sc, float(g)))
    np.testing.assert_allclose(ct.weight, mo.weight, rtol=2e-7)
    fp8 = load_linear(ck, "fp8")
    assert isinstance(fp8, FP8ScaledLinear) and np.array_equal(fp8.weight, E4M3_TABLE[f32_to_e4m3(w)] * 2)
    with pytest.raises(CheckpointError, match=r"bad\.weight.*F8_E4M3"):
        load_linear(ck, "bad")
    assert type(load_linear(ck, "plain")) is DenseLinear


def test_model_loads_modelopt_mixed_precision_checkpoint(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A ModelOpt MIXED_PRECISION layout written here (NVFP4 MLP, per-tensor FP8 attention and GDN projections,
    BF16 in_proj_a/b, head, embeddings), against its exact float twin: the logits must be the same bits."""
    src = Checkpoint.open(tiny_ckpt)
    quant: dict[str, tuple[str, np.ndarray]] = {}
    twin: dict[str, tuple[str, np.ndarray]] = {}
    fp8_mods = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")
    for name in src.names():
        module = name.removesuffix(".weight")
        w = src.get(name) if src.dtype(name) != "U8" else None
        if name.startswith(LP) and module.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")):
            part = _modelopt_tensors(w, module)
            quant.update(part)
            lin = load_linear_from(part, module, tmp_path)
            twin[name] = ("F32", lin)
        elif name.startswith(LP) and module.endswith(fp8_mods):
            scale = np.float32(np.abs(w).max() / 448)
            codes = f32_to_e4m3((w / scale).astype(np.float32))
            quant.update({name: ("F8_E4M3", codes), f"{module}.weight_scale": ("F32", np.array(scale)),
                          f"{module}.input_scale": ("F32", np.array(1.0, np.float32))})
            twin[name] = ("F32", (E4M3_TABLE[codes] * scale).astype(np.float32))
        else:
            quant[name] = twin[name] = (src.dtype(name), np.asarray(src.raw(name)))
    for d, tensors in (("q", quant), ("twin", twin)):
        (tmp_path / d).mkdir()
        save_safetensors(tmp_path / d / "model.safetensors", tensors)
        shutil.copy(tiny_ckpt / "generation_config.json", tmp_path / d)
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    (tmp_path / "twin" / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "group_size": 16,
                                  "exclude_modules": ["lm_head", "model.visual*", "mtp*"]}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    mq, mt = Qwen3_5Model.load(tmp_path / "q"), Qwen3_5Model.load(tmp_path / "twin")
    layer0, layer3 = mq.weights.layers[0], mq.weights.layers[3]
    assert isinstance(layer0.mlp.up, NVFP4Linear) and isinstance(getattr(layer3.mixer, "q"), FP8ScaledLinear)
    assert isinstance(getattr(layer0.mixer, "in_qkv"), FP8ScaledLinear)
    assert type(getattr(layer0.mixer, "in_a")) is DenseLinear
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a = mq.prefill(mq.new_state(16), ids, all_logits=True)
    b = mt.prefill(mt.new_state(16), ids, all_logits=True)
    assert np.array_equal(a, b)


def load_linear_from(part: dict[str, tuple[str, np.ndarray]], module: str, tmp: Path) -> np.ndarray:
    """Dequantize one module's ModelOpt tensors through the loader (via a scratch file)."""
    path = tmp / "scratch.safetensors"
    save_safetensors(path, part)
    lin = load_linear(Checkpoint.open(path), module)
    assert isinstance(lin, NVFP4Linear)
    return lin.weight
