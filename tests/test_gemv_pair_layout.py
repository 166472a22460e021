"""The NVFP4 pair layout of the tensor-core GEMV (tandem/backend/cuda/gemv.py _pair_layout, cuda/gemv.cu
e2m1_pair), on the CPU: the repack is a bijection on 32-bit words, and the kernel's shift-and-mask decode (its NumPy
twin e2m1_pair_bits) of every pair gives exactly e2m1 · 2^-14 of the checkpoint's nibbles k and k + 4, sign
included, for every code. Also the tile-major scale codes (_tile_scales) against the kernels' addresses. No GPU or
CuPy needed."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.backend.cuda import gemv
from tandem.dtypes import E2M1_TABLE


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    w = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    # every code in every nibble position at least once: word v has all 8 nibbles = v % 16
    every = np.array([(v % 16) * 0x11111111 for v in range(16)], dtype=np.uint32)
    return np.concatenate([w, every])


def test_pair_layout_is_a_bijection() -> None:
    rng = np.random.default_rng(0)
    w = _words(rng, 4096)
    packed = gemv._pair_layout(w)
    assert packed.dtype == np.uint32 and not np.array_equal(packed, w)
    assert np.array_equal(gemv._pair_unlayout(packed), w)
    # one bit at a time: every bit lands on a distinct bit
    bits = np.array([1 << b for b in range(32)], dtype=np.uint32)
    moved = gemv._pair_layout(bits)
    assert sorted(int(m).bit_length() - 1 for m in moved) == list(range(32))


@pytest.mark.parametrize("k", range(4))
def test_pair_decode_is_exact(k: int) -> None:
    rng = np.random.default_rng(k)
    w = _words(rng, 4096)
    got = gemv.e2m1_pair_bits(gemv._pair_layout(w), k)
    halves = got.view(np.uint16).reshape(-1, 2).view(np.float16).astype(np.float64) * 2.0 ** 14
    lo = E2M1_TABLE[(w >> np.uint32(4 * k)) & np.uint32(15)].astype(np.float64)
    hi = E2M1_TABLE[(w >> np.uint32(4 * k + 16)) & np.uint32(15)].astype(np.float64)
    assert np.array_equal(halves[:, 0], lo) and np.array_equal(halves[:, 1], hi)
    # the sign of zero too: nibble 8 (-0) decodes to fp16 -0
    neg_zero = gemv.e2m1_pair_bits(gemv._pair_layout(np.array([0x88888888], dtype=np.uint32)), k)
    assert int(neg_zero[0]) == 0x80008000
    with pytest.raises(ValueError):
        gemv.e2m1_pair_bits(w, 4)


def test_staged_variants_fit_and_exist() -> None:
    """Every staged verify variant gemv.py may launch is a kernel cuda/gemv.cu makes (fp32 and glu), and its stages
    with the static warp partials fit a block's shared memory (less the 1 KB the driver reserves a block)."""
    import re

    from tandem.backend.cuda.loader import CUDA_DIR

    text = (CUDA_DIR / "gemv.cu").read_text()
    made = set(re.findall(r"^GEMV_STAGED_PAIR\((\w+), \d, (\d), (\d), (\d)\)", text, re.M))
    listed = {(fmt, v[2], v[4], v[6]) for fmt, vs in gemv.STAGED_VARIANTS.items() for v in vs}
    assert listed == made
    for fmt, mt, ntb, stages in made:
        smem = gemv.staged_smem_bytes(fmt, int(mt), int(ntb), int(stages)) + gemv.staged_static_bytes(int(ntb))
        assert smem <= gemv.SMEM_LIMIT - 1024, (fmt, mt, ntb, stages, smem)
    assert gemv.staged_smem_bytes("nvfp4", 4, 4, 2) == 8 * 2 * (4096 + 8192 + 512)
    for fmt, table in (*gemv.WIDE.items(), *gemv.WIDE_SMALL.items()):
        for variant in table.values():
            assert variant in gemv.WIDE_VARIANTS or variant in gemv.STAGED_VARIANTS[fmt], (fmt, variant)
    assert gemv.is_staged("_p4n1s2") and not gemv.is_staged("_pf") and not gemv.is_staged("_w4n4")


def test_warpgroup_variants_fit_and_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every warpgroup variant gemv.py may launch is a kernel cuda/gemv.cu makes, two blocks of the 3-stage ones fit an
    SM's 228 KB (less the driver's 1 KB a block; the kernels are built for 2 blocks an SM), WGMMA names only such
    variants, and cm_groups picks the class groups measured fastest for the 27B projections on the H200 (132 SMs)."""
    import re

    from tandem.backend.cuda.loader import CUDA_DIR

    text = (CUDA_DIR / "gemv.cu").read_text()
    made = {(fmt, f"_wg{ntb}s{st}") for fmt, _, ntb, st in re.findall(r"^GEMV_WG_PAIR\((\w+), (\d), (\d), (\d)\)",
                                                                         text, re.M)}
    assert made == {(fmt, v) for fmt, vs in gemv.CM_VARIANTS.items() for v in vs}
    for fmt, variant in made:
        ntb, stages, _ = gemv.cm_shape(variant)
        smem = gemv.cm_smem_bytes(fmt, ntb, stages, 1)
        assert 2 * (smem + 1024 + 16) <= 228 * 1024 or stages == 4, (fmt, variant, smem)
    for fmt, table in gemv.WGMMA.items():
        assert all(v in gemv.CM_VARIANTS[fmt] for v in table.values()), fmt
    assert gemv.cm_smem_bytes("nvfp4", 8, 3, 1) == 3 * (8 * (2 * 8 * 128 + 16) + 8192 + 1024) + 32768
    assert gemv.cm_shape("_wg8s3g4") == (8, 3, 4) and gemv.cm_shape("_wg4s4") == (4, 4, 0)
    assert gemv.is_cm("_wg8s3") and not gemv.is_cm("_w4n4") and not gemv.is_cm("_p4n4s2")
    with pytest.raises(ValueError):
        gemv.cm_shape("_w4n4")
    monkeypatch.setattr(gemv, "_device_attr", lambda cache, name: 132)
    picks = {name: gemv.cm_groups(out_dim, 1) for name, out_dim in
             {"gdn_proj": 16480, "gdn_out": 5120, "gate_up": 34816, "down": 5120, "head": 248320}.items()}
    assert picks == {"gdn_proj": 2, "gdn_out": 8, "gate_up": 4, "down": 8, "head": 1}, picks


def test_verify_falls_back_to_wide_kernels_without_the_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemv._verify_variant: the staged kernel WIDE names where the device can give a block its shared memory,
    WIDE_FALLBACK's wide kernel (or gemv_mma) where it cannot."""
    monkeypatch.setattr(gemv, "wgmma_available", lambda: False)
    monkeypatch.setattr(gemv, "_device_attr", lambda cache, name: gemv.SMEM_LIMIT)
    for fmt, table in gemv.WIDE.items():
        for tiles, variant in table.items():
            assert gemv._verify_variant(fmt, tiles) == variant
    monkeypatch.setattr(gemv, "_device_attr", lambda cache, name: 99 * 1024)
    assert gemv._verify_variant("nvfp4", 8) == "_w4n4" and gemv._verify_variant("bf16", 8) == "_w2n8"
    assert gemv._verify_variant("nvfp4", 2) == "_w2n2"
    assert gemv._verify_variant("nvfp4", 1) == ""  # gemv_mma
    assert gemv._verify_variant("fp8", 1) == ""  # no staged kernel at one tile: gemv_mma
    monkeypatch.setattr(gemv, "_device_attr", lambda cache, name: 163 * 1024)
    assert gemv._verify_variant("nvfp4", 8) == "_w4n4"
    assert 1 not in gemv.WIDE["nvfp4"] and gemv._verify_variant("nvfp4", 1) == ""  # one tile: gemv_mma (faster in the engine)
    assert gemv._verify_variant("fp8", 8) == "_p4n4s2" and gemv._verify_variant("bf16", 8) == "_w2n8"  # 148, 163 KB
    monkeypatch.setattr(gemv, "wgmma_available", lambda: True)  # sm_90: WGMMA's tiles take the warpgroup kernels
    assert gemv._verify_variant("nvfp4", 8, 34816, 5120) == "_wg8s3" and gemv._verify_variant("fp8", 5, 248320,
                                                                                                4096) == "_wg8s3"
    assert gemv._verify_variant("nvfp4", 8, 4096, 4096) == "_w4n4"  # 9B gdn_out: WIDE's (here its fallback)
    assert gemv._verify_variant("nvfp4", 4, 34816, 5120) == "_w4n4"
    assert gemv._verify_variant("bf16", 8, 34816, 5120) == "_w2n8"
    # the out = hidden projections at 5-8 rows (2 tiles): WIDE_SMALL's where it names one, else WIDE's
    assert gemv._verify_variant("nvfp4", 2, 5120, 17408) == gemv.WIDE_SMALL["nvfp4"][2] == "_p1n2s2"
    assert gemv._verify_variant("nvfp4", 2, 34816, 5120) == gemv.WIDE["nvfp4"][2] == "_p2n2s2"
    assert gemv._verify_variant("fp8", 2, 5120, 17408) == gemv.WIDE["fp8"][2] == "_p4n2s2"
    assert gemv._verify_variant("nvfp4", 2, gemv.WIDE_SMALL_OUT + 16, 5120) == "_p2n2s2"


@pytest.mark.parametrize("out_dim", [16, 40, 5])
def test_tile_major_scales_match_the_kernel_addresses(out_dim: int) -> None:
    """_tile_scales puts each scale code where cuda/gemv.cu reads it: load_chunk's lane (g, c) of tile t, chunk q
    reads u16 ((t · chunks + q) · 64 + 4 g + c) for row 16 t + g and that + 32 for row 16 t + g + 8 (groups 8 q + 2 c
    and + 1); the staged and warpgroup copies take row r's 8 bytes at u16 (t · chunks + q) · 64 + 4 r. Padded rows
    are zero and _untile_scales gives the codes back."""
    rng = np.random.default_rng(out_dim)
    chunks = 3
    codes = rng.integers(1, 256, size=(out_dim, 8 * chunks), dtype=np.uint8)
    tiled = gemv._tile_scales(codes)
    tiles = -(-out_dim // 16)
    assert tiled.shape == (tiles * chunks * 128,) and tiled.dtype == np.uint8
    as_u16 = tiled.view(np.uint16)
    for t in range(tiles):
        for q in range(chunks):
            for g in range(8):
                for c in range(4):
                    for row, idx in ((16 * t + g, (t * chunks + q) * 64 + 4 * g + c),
                                     (16 * t + g + 8, (t * chunks + q) * 64 + 32 + 4 * g + c)):
                        want = (int(codes[row, 8 * q + 2 * c]) | int(codes[row, 8 * q + 2 * c + 1]) << 8
                                if row < out_dim else 0)
                        assert int(as_u16[idx]) == want
            for r in range(16):
                piece = tiled[2 * ((t * chunks + q) * 64 + 4 * r):][:8]
                row = 16 * t + r
                assert np.array_equal(piece, codes[row, 8 * q:8 * q + 8] if row < out_dim else np.zeros(8, np.uint8))
    assert np.array_equal(gemv._untile_scales(tiled, out_dim, 8 * chunks), codes)
    one = gemv._tile_scales(codes[:, :8])  # in = 128: the untiled view would be contiguous; still a copy
    back = gemv._untile_scales(one, out_dim, 8)
    assert np.array_equal(back, codes[:, :8]) and back.flags.c_contiguous and not np.shares_memory(back, one)
    with pytest.raises(ValueError):
        gemv._tile_scales(codes[:, :12])
