"""The GEMV kernel variants and the tables that choose among them by format and MMA column tiles (cuda/gemv.cu:
gemv_mma (decode), gemv_mma_wide "_w<MT>n<NTB>", gemv_mma_staged "_p<MT>n<NTB>s<S>", gemv_mma_wg "_wg<NTB>s<S>"), the
parsing of variant names and the shared memory each takes. All variants of a format give a row the bits of the
one-row kernel, so these tables change speed only. gemv.py reads the tables at each launch (so a bench setting
``gemv.NAME=...`` on the names gemv.py imports takes effect there); the measurements behind them are in
docs/performance.md.
"""

from __future__ import annotations

import re

ROWS_PER_BLOCK = 16  # v1: 8 warps × 2 output rows; v2: one 16-row MMA tile (cuda/gemv.cu)
# v2 (tensor-core) path: k elements per 16-byte weight vector, parts of x, tokens per MMA column tile
MMA_E = {"bf16": 8, "fp8": 16, "nvfp4": 32}
# Wide kernels for verify rows (cuda/gemv.cu gemv_mma_wide, same bits as the n kernels): "_w<MT>n<NTB>".
WIDE_VARIANTS = ("_w1n8", "_w2n2", "_w2n4", "_w2n8", "_w4n2", "_w4n4")
# Staged verify kernels (cuda/gemv.cu gemv_mma_staged: the wide kernels' arithmetic, so the same bits, with each
# chunk's weights, scales and x copied into shared memory S - 1 chunks ahead): "_p<MT>n<NTB>s<S>", the instances
# each format has (those whose S stages fit a block's 227 KB of shared memory).
STAGED_VARIANTS: dict[str, tuple[str, ...]] = {
    "bf16": ("_p4n2s2", "_p4n2s3", "_p2n4s2", "_p2n4s3", "_p4n4s2", "_p4n4s3", "_p2n8s2", "_p2n8s3"),
    "fp8": ("_p4n1s3", "_p4n2s2", "_p4n2s3", "_p2n4s2", "_p2n4s3", "_p4n4s2", "_p4n4s3", "_p2n8s2"),
    "nvfp4": ("_p4n1s2", "_p4n1s3", "_p4n2s2", "_p4n2s3", "_p2n4s2", "_p4n4s2", "_p2n2s2", "_p1n2s2"),
}
# Warpgroup verify kernels (cuda/gemv.cu gemv_mma_wg, sm_90 only): class-major blocks (all warps of a block on one
# chunk, each its own 16-row tile, one x stage a block, each weight decoded once for all the block's tokens; chunks
# visited class by class and the class sums folded in class order, so the same bits), each k-step's MMAs one wgmma
# (the same bits as mma.sync: tools/wgmma_bits.py): "_wg<NTB>s<S>", FP8 and NVFP4. A variant may end in "g<CG>"
# (bench and tests: force CG class groups; default ``cm_groups``).
CM_VARIANTS: dict[str, tuple[str, ...]] = {
    "fp8": ("_wg8s3", "_wg8s4", "_wg4s4"),
    "nvfp4": ("_wg8s3", "_wg8s4", "_wg4s4"),
}
# The kernel a launch of more than one row and `tiles` MMA column tiles (tokens / TPT, capped at 8) takes per
# format; absent: gemv_mma (as decode). One row (decode) always takes gemv_mma. FP8 and NVFP4 keep gemv_mma at one
# tile (2-4 rows): the staged one-tile kernels were slower inside the engine's small verifies than alone. NVFP4 at
# two tiles takes _p2n2s2 (fewer registers than _p4n2s2: two blocks an SM where the shared memory allows); FP8 and
# BF16 keep _p4n2s2 there. Measured with bench/gemv.py and bench/ab_decode.py (docs/performance.md).
WIDE: dict[str, dict[int, str]] = {
    "nvfp4": {2: "_p2n2s2", **{t: "_p4n4s2" for t in range(3, 9)}},
    "fp8": {2: "_p4n2s2", **{t: "_p4n4s2" for t in range(3, 9)}},
    "bf16": {2: "_p4n2s2", **{t: "_p4n4s3" for t in range(3, 9)}},
}
# Where the device runs them (sm_90: ``wgmma_available``), verify launches of these MMA column tiles take the warpgroup
# kernels instead of WIDE's. Only projections with in >= WGMMA_MIN_IN or out >= WGMMA_MIN_OUT take them: below that
# (e.g. the 9B's in = 4096 projections) the staged kernels were as fast or faster, while the heads gained. At 4
# tiles (16 rows) _wg4s4 was slower than the staged kernels for most shapes, so it is not used.
WGMMA: dict[str, dict[int, str]] = {
    "nvfp4": {t: "_wg8s3" for t in range(5, 9)},
    "fp8": {t: "_wg8s3" for t in range(5, 9)},
}
WGMMA_MIN_IN, WGMMA_MIN_OUT = 5120, 65536
# Verify kernels for weights of at most WIDE_SMALL_OUT output rows, per format and column tiles, in place of WIDE's;
# absent: WIDE's. A size rule: at the 27B and 9B shapes the launches it takes are the out = hidden GEMVs (GDN out,
# attention o, MLP down); smaller models' other projections may take it too (the same bits: every staged instance is
# wide_chunk's arithmetic). At 5-8 rows _p4n2s2 takes 64 rows a block, so a 27B out = 5120 projection is 80 blocks on
# 132 SMs; _p1n2s2 (16 rows a block, two blocks an SM where the shared memory allows) gives 320. FP8 keeps WIDE's
# (_p1n2s2 was slower there).
WIDE_SMALL: dict[str, dict[int, str]] = {"nvfp4": {2: "_p1n2s2"}}
WIDE_SMALL_OUT = 8192
ONE_TILE = "_n"  # the variant name that forces gemv_mma, the decode kernel (NTB = 1, 2 or 4 column tiles by rows), at
# any row count (bench/gemv.py --variants)
SMEM_LIMIT = 232448  # bytes of shared memory a block may opt in to on sm_90 (227 KB)
# Formats whose residual + norm GEMV (matmul_residual_norm: GDN out, attention o, MLP down) takes the register
# prefetch kernel (_pf, same bits); both were faster with it (bench/ab_decode.py --settings
# ";gemv.RESNORM_PF=();gemv.RESNORM_PF=('nvfp4','fp8')").
RESNORM_PF = ("nvfp4", "fp8")
# Verify kernels where a device cannot give a block the staged kernel's shared memory (sm_80 opts in to 163 KB, sm_86 /
# sm_89 / sm_120 to 99 KB): the wide kernels (2 tiles _w2n2, 3 or more _w4n4, BF16 at 8 tiles _w2n8).
WIDE_FALLBACK: dict[str, dict[int, str]] = {fmt: {2: "_w2n2", **{t: "_w4n4" for t in range(3, 9)}}
                                            for fmt in ("bf16", "fp8", "nvfp4")}
WIDE_FALLBACK["bf16"][8] = "_w2n8"
# Staged launches that run persistent (about one wave of blocks, each taking several row blocks in turn, the ring
# running on across them) rather than one block a row block: NVFP4 with 4 column tiles a block (faster at 16 and 32
# rows); the other formats and NVFP4 at fewer tiles launch one block a row block (same kernel, G = row blocks; the
# same bits either way).
PERSISTENT = {"nvfp4": 4}  # format -> the fewest column tiles a block for which its staged launches are persistent
CM_ROWS = 128  # output rows a class-major block takes (8 warps × one 16-row tile)


# cm_groups' rule: (most blocks of 128 rows an SM, class groups), first match; more than the last bound: 1 group.
CM_GROUP_RULE: tuple[tuple[float, int], ...] = ((0.5, 8), (1.2, 2), (4.5, 4))


def is_staged(variant: str) -> bool:
    """Whether ``variant`` names a staged verify kernel ("_p<MT>n<NTB>s<S>"; "_pf" is a one-tile variant)."""
    return re.fullmatch(r"_p\d+n\d+s\d+", variant) is not None


def staged_shape(variant: str) -> tuple[int, int, int]:
    """(MT, NTB, S) of a staged variant name "_p<MT>n<NTB>s<S>"."""
    return int(variant[2]), int(variant[4]), int(variant[6])


def staged_smem_bytes(fmt: str, mt: int, ntb: int, stages: int) -> int:
    """Dynamic shared memory of a staged verify kernel, in bytes: 8 warps × ``stages`` stages of cuda/gemv.cu's
    StageLayout: ``mt`` weight kilobytes, ``ntb`` column tiles of x (32 lanes × E / 8 pieces of 16 bytes each), and
    the scales (NVFP4 128 bytes a row tile, FP8 8 bytes a row tile padded to 16)."""
    scales = mt * 128 if fmt == "nvfp4" else (mt * 8 + 15) // 16 * 16 if fmt == "fp8" else 0
    return 8 * stages * (mt * 1024 + ntb * 32 * (MMA_E[fmt] // 8) * 16 + scales)


def staged_static_bytes(ntb: int) -> int:
    """Static shared memory of a staged verify kernel beyond its stages, in bytes: the warp partials (8 warps × NTB
    column tiles × 16 rows × 9 floats) and the glu epilogue's tile (NTB · 4 tokens × 17 floats)."""
    return 8 * ntb * 16 * 9 * 4 + ntb * 4 * 17 * 4


_CM = re.compile(r"_wg(\d+)s(\d+)(?:g(\d+))?")


def is_cm(variant: str) -> bool:
    """Whether ``variant`` names a warpgroup verify kernel ("_wg<NTB>s<S>", optionally with "g<CG>")."""
    return _CM.fullmatch(variant) is not None


def cm_shape(variant: str) -> tuple[int, int, int]:
    """(NTB, S, CG) of a warpgroup variant name (CG 0: ``cm_groups`` chooses).
    Raises: ValueError if ``variant`` is not one."""
    m = _CM.fullmatch(variant)
    if m is None:
        raise ValueError(f"not a warpgroup variant: {variant!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def cm_smem_bytes(fmt: str, ntb: int, stages: int, groups: int) -> int:
    """Dynamic shared memory of a warpgroup kernel, in bytes (cuda/gemv.cu WgLayout): ``stages`` stages of x (E / 4
    k-step tiles of 2 × ``ntb`` × 128 bytes + 16), the 8 warps' weight kilobytes and scales (NVFP4 128 bytes a warp,
    FP8 16), each stage rounded up to 128 bytes; and with one class group the fold (8 warps × ntb × 4 × 32 fp32)."""
    e, scales = MMA_E[fmt], 8 * (128 if fmt == "nvfp4" else 16)
    stage = -(-((e // 4) * (2 * ntb * 128 + 16) + 8 * 1024 + scales) // 128) * 128
    return stages * stage + (8 * ntb * 4 * 32 * 4 if groups == 1 else 0)
