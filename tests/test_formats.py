"""Linear formats: dense and FP8 block-scaled weights, row invariance (tandem/formats/linear.py)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.dtypes import bf16_to_f32, f32_to_bf16, f32_to_e4m3
from tandem.formats import DenseLinear, FP8BlockLinear, Linear, dequantize_fp8_block, load_linear
from tools.make_checkpoint import dequantize_checkpoint, quantize_fp8_block, save_safetensors

LP = "model.language_model.layers."


@pytest.mark.parametrize("out_dim,in_dim", [(300, 200), (64, 128), (7, 5)])
def test_row_invariance_and_accuracy(out_dim: int, in_dim: int) -> None:
    rng = np.random.default_rng(0)
    lin = DenseLinear(rng.normal(0, 1, (out_dim, in_dim)).astype(np.float32))
    x = rng.normal(0, 1, (32, in_dim)).astype(np.float32)
    y = lin.matmul(x)
    assert y.shape == (32, out_dim) and y.dtype == np.float32
    for i in range(32):
        assert np.array_equal(y[i], lin.matmul(x[i:i + 1])[0]), f"row {i} differs between T=32 and T=1"
    assert np.array_equal(y[5:9], lin.matmul(x[5:9]))
    ref = x.astype(np.float64) @ lin.weight.astype(np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    assert lin.bytes_per_use == out_dim * in_dim * 4 and isinstance(lin, Linear)


def test_matmul_rejects_bad_input() -> None:
    lin = DenseLinear(np.zeros((4, 3), np.float32), "blk.w")
    with pytest.raises(ValueError, match=r"blk\.w.*\[T, 3\]"):
        lin.matmul(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="float32"):
        lin.matmul(np.zeros((2, 3), np.float64))  # type: ignore[arg-type]


@pytest.mark.parametrize("scale_dtype", ["BF16", "F32"])
def test_fp8_dequant_matches_float64_reference_ragged(scale_dtype: str) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (300, 200)).astype(np.float32)  # grid [3, 2], ragged last blocks
    (_, codes), (sdt, sbits) = quantize_fp8_block(w, scale_dtype)
    assert sdt == scale_dtype and sbits.shape == (3, 2)
    scale = bf16_to_f32(sbits) if scale_dtype == "BF16" else sbits
    q = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    rows, cols = np.arange(300) // 128, np.arange(200) // 128
    ref = q * scale.astype(np.float64)[rows[:, None], cols[None, :]]
    lin = FP8BlockLinear(codes, scale, int(sbits.nbytes), "t")
    # One correctly rounded float32 product; exact when the scale is BF16 (4 + 8 mantissa bits fit float32).
    assert np.array_equal(lin.weight, ref.astype(np.float32))
    if scale_dtype == "BF16":
        assert np.array_equal(lin.weight.astype(np.float64), ref)
    np.testing.assert_allclose(lin.weight, w, rtol=0.07, atol=1e-4)  # e4m3 quantisation error
    assert lin.stored_bytes == 300 * 200 + sbits.nbytes and lin.bytes_per_use == 300 * 200 * 4
    x = rng.normal(0, 1, (3, 200)).astype(np.float32)
    assert np.array_equal(lin.matmul(x)[1], lin.matmul(x[1:2])[0])


def test_fp8_bad_scale_grid() -> None:
    with pytest.raises(CheckpointError, match=r"blk\.weight_scale_inv.*\[2, 2\].*expected \[3, 2\]"):
        dequantize_fp8_block(np.zeros((300, 200), np.float32), np.ones((2, 2), np.float32), "blk")


def test_load_linear_picks_format(tiny_ckpt: Path, tiny_ckpt_fp8: Path) -> None:
    dense, fp8 = Checkpoint.open(tiny_ckpt), Checkpoint.open(tiny_ckpt_fp8)
    for prefix in (f"{LP}0.linear_attn.in_proj_qkv", f"{LP}3.self_attn.q_proj", f"{LP}1.mlp.down_proj",
                   "mtp.layers.0.self_attn.o_proj"):
        a, b = load_linear(dense, prefix), load_linear(fp8, prefix)
        assert isinstance(a, DenseLinear) and not isinstance(a, FP8BlockLinear)
        assert isinstance(b, FP8BlockLinear) and a.shape == b.shape == dense.shape(prefix + ".weight")
        assert fp8.dtype(prefix + ".weight") == "F8_E4M3" and fp8.dtype(prefix + ".weight_scale_inv") == "BF16"
        np.testing.assert_allclose(b.weight, a.weight, rtol=0.07, atol=2e-4)  # same seed, quantised
    for prefix in (f"{LP}0.linear_attn.in_proj_a", "mtp.fc", "lm_head"):
        assert not isinstance(load_linear(fp8, prefix), FP8BlockLinear)
    with pytest.raises(CheckpointError, match="not found"):
        load_linear(dense, f"{LP}0.self_attn.q_proj")  # layer 0 is GDN


def test_load_linear_rejects_non_fp8_with_scale(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "model.safetensors", {
        "m.weight": ("BF16", f32_to_bf16(np.ones((4, 4), np.float32))),
        "m.weight_scale_inv": ("F32", np.ones((1, 1), np.float32))})
    with pytest.raises(CheckpointError, match="m.weight.*F8_E4M3"):
        load_linear(Checkpoint.open(tmp_path), "m")


def test_dequantized_twin_is_exact(tiny_ckpt_fp8: Path, tmp_path: Path) -> None:
    fp8 = Checkpoint.open(tiny_ckpt_fp8)
    twin = Checkpoint.open(dequantize_checkpoint(tiny_ckpt_fp8, tmp_path / "twin"))
    assert not any(n.endswith("weight_scale_inv") for n in twin.names())
    for name in fp8.names():
        prefix = name.removesuffix(".weight")
        if fp8.has(prefix + ".weight_scale_inv"):
            lin = load_linear(fp8, prefix)
            assert twin.dtype(name) == "F32" and isinstance(lin, FP8BlockLinear)
            assert np.array_equal(twin.get(name), lin.weight)
        elif not name.endswith("weight_scale_inv"):
            assert twin.dtype(name) == fp8.dtype(name) and np.array_equal(twin.raw(name), fp8.raw(name))


def test_fp8_codes_from_encoder_match_ml_dtypes_on_checkpoint(tiny_ckpt_fp8: Path) -> None:
    ck = Checkpoint.open(tiny_ckpt_fp8)
    w = ck.get(f"{LP}0.mlp.up_proj.weight")
    assert np.array_equal(f32_to_e4m3(w), ck.raw(f"{LP}0.mlp.up_proj.weight"))  # decode/encode round trip
