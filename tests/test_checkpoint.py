"""Checkpoint reading: dtypes, layouts, bad inputs (tandem/checkpoint.py, tandem/dtypes.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.dtypes import E4M3_TABLE, bf16_to_f32, e4m3_to_f32, f16_to_f32, f32_to_bf16, f32_to_e4m3
from tools.make_checkpoint import save_safetensors, write_checkpoint


def test_e4m3_all_256_codes_match_ml_dtypes() -> None:
    codes = np.arange(256, dtype=np.uint8)
    ours = e4m3_to_f32(codes)
    ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    assert np.isnan(ours[[0x7F, 0xFF]]).all() and np.isnan(ours).sum() == 2
    ok = ~np.isnan(ref)
    assert np.array_equal(ours[ok].view(np.uint32), ref[ok].view(np.uint32))  # bits, so -0.0 counts
    assert np.nanmax(E4M3_TABLE) == 448.0


def test_e4m3_encoder_matches_ml_dtypes_in_range_and_saturates() -> None:
    rng = np.random.default_rng(0)
    finite = E4M3_TABLE[~np.isnan(E4M3_TABLE)]
    mids = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2  # exact ties exercise round-to-even
    x = np.concatenate([finite, mids, rng.normal(0, 30, 10000), rng.normal(0, 0.01, 1000)])
    x = np.clip(x, -448, 448).astype(np.float32)
    ref = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    ours = f32_to_e4m3(x)
    same = (ours == ref) | ((e4m3_to_f32(ours) == 0) & (e4m3_to_f32(ref) == 0))
    assert same.all(), x[~same][:5]
    assert list(f32_to_e4m3(np.array([1e6, -500.0, np.nan], np.float32))) == [0x7E, 0xFE, 0x7F]


def test_bf16_f16_round_trip_and_encoder_matches_ml_dtypes() -> None:
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ref = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    ours = bf16_to_f32(bits)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.array_equal(f32_to_bf16(ours[~nan]), bits[~nan])  # exact values round-trip
    x = np.random.default_rng(1).normal(0, 1e3, 100000).astype(np.float32)
    x = np.concatenate([x, (ours[~nan][:1000] + np.float32(0))])
    assert np.array_equal(f32_to_bf16(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32)))).all()
    h = bits.view(np.float16)
    ok = ~np.isnan(h)
    assert np.array_equal(f16_to_f32(bits)[ok], h[ok].astype(np.float32))


def _write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(path / "model.safetensors", tensors)
    return path


def test_all_dtypes_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(0, 3, (5, 7)).astype(np.float32)
    tensors = {"bf16": ("BF16", f32_to_bf16(x)), "f16": ("F16", x.astype(np.float16).view(np.uint16)),
               "f32": ("F32", x), "fp8": ("F8_E4M3", f32_to_e4m3(x)), "u8": ("U8", np.arange(6, dtype=np.uint8))}
    ck = Checkpoint.open(_write(tmp_path, tensors))
    assert ck.names() == sorted(tensors)
    for name, (dtype, bits) in tensors.items():
        assert ck.dtype(name) == dtype and ck.shape(name) == bits.shape
        assert np.array_equal(ck.raw(name), bits) and ck.raw(name).dtype == bits.dtype
    assert np.array_equal(ck.get("bf16"), bf16_to_f32(f32_to_bf16(x)))
    assert np.array_equal(ck.get("f16"), x.astype(np.float16).astype(np.float32))
    assert np.array_equal(ck.get("f32", shape=(5, 7)), x)
    assert np.array_equal(ck.get("fp8"), x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert ck.get("f32").dtype == np.float32
    assert Checkpoint.open(tmp_path / "model.safetensors").names() == ck.names()  # single-file path


def test_sharded_equals_single_file(tmp_path: Path) -> None:
    sharded = Checkpoint.open(write_checkpoint(tmp_path / "a", num_shards=3))
    single = Checkpoint.open(write_checkpoint(tmp_path / "b", num_shards=1))
    assert len({i.file for i in map(sharded.info, sharded.names())}) == 3
    assert sharded.names() == single.names()
    for name in single.names():
        assert single.dtype(name) == sharded.dtype(name)
        assert np.array_equal(single.raw(name), sharded.raw(name))


def test_layout_text_and_mtp_names(tiny_ckpt: Path) -> None:
    ck = Checkpoint.open(tiny_ckpt)
    assert ck.language_model_prefix == "model.language_model."
    text, mtp = ck.text_names(), ck.mtp_names()
    assert any(n.startswith("model.visual.") for n in ck.names())
    assert not any(n.startswith(("model.visual.", "mtp.")) for n in text)
    assert "lm_head.weight" in text and "mtp.fc.weight" in mtp
    assert set(text) | set(mtp) | {n for n in ck.names() if n.startswith("model.visual.")} == set(ck.names())
    p = "model.language_model.layers.0.linear_attn."
    assert ck.dtype(p + "A_log") == "F32" and ck.dtype(p + "norm.weight") == "F32"
    assert ck.dtype(p + "in_proj_qkv.weight") == "BF16" and ck.shape(p + "conv1d.weight") == (128, 1, 4)
    assert ck.shape("model.language_model.layers.3.self_attn.q_proj.weight") == (256, 64)
    assert ck.shape("mtp.fc.weight") == (64, 128)
    assert len(text) == 3 * 14 + 11 + 3  # spec §2.1 count: GDN 14, attention 11, globals 3


def test_flat_prefix(tmp_path: Path) -> None:
    ck = Checkpoint.open(_write(tmp_path, {"model.embed_tokens.weight": ("F32", np.zeros((2, 2), np.float32))}))
    assert ck.language_model_prefix == "model."


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither"):
        Checkpoint.open(tmp_path)


def test_missing_shard(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "c", num_shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        Checkpoint.open(d)


def test_missing_tensor_names_close_matches(tiny_ckpt: Path) -> None:
    ck = Checkpoint.open(tiny_ckpt)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.up_prj\.weight.*close names.*up_proj"):
        ck.get("model.language_model.layers.0.mlp.up_prj.weight")


def test_wrong_shape(tiny_ckpt: Path) -> None:
    ck = Checkpoint.open(tiny_ckpt)
    with pytest.raises(CheckpointError, match=r"norm\.weight.*shape \[64\], expected \[65\]"):
        ck.get("model.language_model.norm.weight", shape=(65,))


def test_truncated_file(tmp_path: Path) -> None:
    d = _write(tmp_path, {"w": ("F32", np.ones((16, 16), np.float32))})
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="'w'.*truncated"):
        Checkpoint.open(d)
    f.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        Checkpoint.open(d)


def test_bad_header_json(tmp_path: Path) -> None:
    bad = b'{"w": {"dtype": '
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint.open(tmp_path)


def test_bad_index(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="index"):
        Checkpoint.open(tmp_path)
    d = write_checkpoint(tmp_path / "c", num_shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="ghost.weight"):
        Checkpoint.open(d)


def test_unknown_dtype_raises_on_read(tmp_path: Path) -> None:
    d = _write(tmp_path, {"ok": ("F32", np.ones(2, np.float32)), "odd": ("F4_XX", np.zeros(3, np.uint8))})
    ck = Checkpoint.open(d)  # opening is fine; reading the tensor is not
    assert ck.dtype("odd") == "F4_XX" and np.array_equal(ck.get("ok"), [1, 1])
    with pytest.raises(CheckpointError, match="'odd'.*unknown dtype 'F4_XX'"):
        ck.raw("odd")
    with pytest.raises(CheckpointError, match="'odd'.*'F4_XX'"):
        ck.get("odd")


def test_transformers_loads_written_checkpoint(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The writer's layout is what transformers expects: no missing weights, values bit-equal, forward runs."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_reference import load_hf_causal_lm

    ck = Checkpoint.open(tiny_ckpt)
    model = load_hf_causal_lm(tiny_ckpt)
    params = dict(model.named_parameters())
    assert len(params) == len(ck.text_names())
    for name, p in params.items():
        src = name if name == "lm_head.weight" else name.replace("model.", ck.language_model_prefix, 1)
        assert np.array_equal(ck.get(src, shape=tuple(p.shape)), p.detach().numpy()), name
    with torch.no_grad():
        logits = model(input_ids=torch.arange(12).reshape(1, 12)).logits
    assert logits.shape == (1, 12, 512) and torch.isfinite(logits).all()
    tied = write_checkpoint(tmp_path / "tied", tie_word_embeddings=True, num_shards=1, with_vision=False)
    assert not Checkpoint.open(tied).has("lm_head.weight")
    load_hf_causal_lm(tied)
