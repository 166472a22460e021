"""Row-invariant GEMV / skinny GEMM (1–64 rows) on the GPU for BF16, FP8 block-scaled and NVFP4 weights.

Kernels: cuda/gemv.cu, v2 (tensor cores, mma.sync with x split into fp16 / bf16 parts; shapes with in % 32 / 64 /
128 == 0 for BF16 / FP8 / NVFP4) and v1 (CUDA cores, any in % 8 / 16 / 32 == 0). Each class mirrors the host
`Linear` protocol (tandem/formats): `shape` (out, in), `bytes_per_use` (weight bytes one call reads: codes + scales
as stored) and `matmul(x)` with x [T, in] float32 on the device. Row t of the result has the same bits for any T
(the kernel's reduction order depends only on `in`).

Epilogues that save the decode step a launch each, with the bits of the launches they replace: `glu_pair` (SiLU·mul
of gate and up, rows interleaved), `matmul_residual_norm` (residual add + the next RMSNorm, one row) and
`matmul_conv` (the GDN causal conv, one row); they write the next kernel's operand (`split_operand`).

Verify rows (more than one row) take the kernel `WIDE` names for their column-tile count: a staged kernel (cuda/gemv.cu
gemv_mma_staged: each warp's weights, scales and x words copied into shared memory chunks ahead), or where the device
cannot give a block that shared memory a wide one (`WIDE_FALLBACK`, gemv_mma_wide: a warp reuses x's words for several
row tiles), all with the bits of the one-row kernel. Weight codes are stored tile-major (`_tile`; NVFP4 words also in
the pair layout, `_pair_layout`; `rows()` gives them back as the checkpoint has them), NVFP4 scale codes too
(`_tile_scales`; `scale_codes` gives them back).
`split_pieces` splits a fused projection's output for several rows in one launch.
The pieces below the launchers live beside this file: gemv_variants.py (the variant tables and names), gemv_layout.py
(the weight layouts) and operand.py (the split operand, ``prepare``, ``split_pieces``); this module re-exports them,
and the launch selection here reads the tables through its own names (``gemv.WIDE`` etc.), so a bench setting or a
test's monkeypatch of ``gemv.NAME`` takes effect.

Reference (`reference_*`): float64 x · Wᵀ with W dequantized by the host formats (tandem.dtypes.bf16_to_f32,
tandem.formats.dequantize_fp8_block, tandem.formats.dequantize_nvfp4); fp32 accumulation keeps the relative
error near 1e-6 (tests bound it by 1e-5).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda import loader
from tandem.backend.cuda.loader import cupy, kernel, persistent, raise_smem_limit
# the layouts, variant tables and operand helpers are re-exported: tests and bench read them as gemv.NAME
from tandem.backend.cuda.gemv_layout import (_tile, _tile_scales, _untile_scales, PAIR_SLOTS, _pair_layout,
                                             _pair_unlayout, e2m1_pair_bits, _untile)
from tandem.backend.cuda.gemv_variants import (ROWS_PER_BLOCK, MMA_E, WIDE_VARIANTS, STAGED_VARIANTS, CM_VARIANTS,
                                               WIDE, WGMMA, WGMMA_MIN_IN, WGMMA_MIN_OUT, WIDE_SMALL, WIDE_SMALL_OUT,
                                               ONE_TILE, SMEM_LIMIT, RESNORM_PF, WIDE_FALLBACK, PERSISTENT, CM_ROWS,
                                               CM_GROUP_RULE, is_staged, staged_shape, staged_smem_bytes,
                                               staged_static_bytes, _CM, is_cm, cm_shape, cm_smem_bytes)
from tandem.backend.cuda.operand import PARTS, SPLIT_CODE, NULL, split_operand, prepare, split_cols, split_pieces
from tandem.backend.cuda.rms_norm import add_rms_norm
from tandem.dtypes import bf16_to_f32
from tandem.formats import dequantize_fp8_block, dequantize_nvfp4

KERNELS = ("gemv_bf16_t##TT", "gemv_fp8_t##TT", "gemv_nvfp4_t##TT", "gemv_prep", "gemv_split_cols",
           # v2, one macro: gemv_mma_<bf16|fp8|nvfp4>_<n1|n2|n4|n1_glu|n2_glu|n4_glu|n1_resnorm[_rows][_pf]|
           # n1_conv|n1_u2|n1_u4|n1_u8|n1_pf> (GEMV_MMA_FORMAT), the wide verify kernels
           # gemv_mma_<fmt>_w<MT>n<NTB>[_glu] (GEMV_WIDE_FORMAT)
           # the staged verify kernels gemv_mma_<fmt>_p<MT>n<NTB>s<S>[_glu] (GEMV_STAGED_PAIR), the warpgroup
           # gemv_mma_<fmt>_wg<NTB>s<S>[_glu] (GEMV_WG_PAIR)
           # the routed experts' kernels gemv_mma_<fmt>_moe_n<1|4>[_glu] (GEMV_MOE_FORMAT; launched by moe.py)
           "gemv_mma_##FS", "gemv_mma_##WS", "gemv_mma_##PS", "gemv_mma_##GS", "gemv_mma_##MS")
THREADS = 256
PREP_KIND = {"bf16": "bf16", "fp8": "f16", "nvfp4": "f16p"}  # xs layout each format's v2 kernel reads


def row_tile(num_rows: int) -> int:
    """v1: rows of x that share one weight read: 1, 2, 4 or 8 (does not change any row's bits)."""
    return 1 if num_rows == 1 else 2 if num_rows == 2 else 4 if num_rows <= 4 else 8


def _launch(fmt: str, out_dim: int, x: Any, out: Any, args: tuple[Any, ...]) -> Any:
    num_rows, in_dim = x.shape
    y = out_or_new("out", out, (num_rows, out_dim))
    tt = row_tile(num_rows)
    grid = (-(-out_dim // ROWS_PER_BLOCK), -(-num_rows // tt))
    kernel("gemv", f"gemv_{fmt}_t{tt}")(grid, (THREADS,), (*args, x, y, i32(out_dim), i32(in_dim), i32(num_rows)))
    return y


def wgmma_available() -> bool:
    """Whether the current device runs the warpgroup kernels (sm_90: cuda/gemv.cu builds them for sm_90a there)."""
    return loader.compute_capability() == "90"


def cm_groups(out_dim: int, token_blocks: int) -> int:
    """Class groups (1, 2, 4 or 8) a class-major / warpgroup launch splits each row block's 8 chunk classes into, by
    its blocks of 128 rows (all token blocks) per multiprocessor (``CM_GROUP_RULE``): up to 0.5 -> 8, up to 1.2 -> 2,
    up to 4.5 -> 4, more -> 1. A rule read off measured 27B projections at 32 rows (bench/gemv.py --variants
    _wg8s3g1,_wg8s3g2,...; docs/performance.md): few row blocks an SM want many groups, many want one. (A model of
    waves and per-block cost did not rank them right.)"""
    sms = _device_attr(_sm_count, "MultiProcessorCount")
    per_sm = -(-out_dim // CM_ROWS) * token_blocks / sms
    return next((groups for bound, groups in CM_GROUP_RULE if per_sm <= bound), 1)


_cm_workspace: dict[int, list[Any]] = {}  # device -> workspaces (fp32), newest last; never freed (plans keep them)
_cm_counters: dict[int, list[Any]] = {}  # device -> zeroed uint32 ticket arrays, newest last


def _cm_buffers(floats: int, tickets: int) -> tuple[Any, Any]:
    """A workspace of at least ``floats`` fp32 and a zeroed ticket array of at least ``tickets`` uint32 for class-major
    launches with class groups (each launch's last block of a row block resets its ticket; launches on one stream run
    one after another, so one pair per device serves them all). Grown by allocating anew, under loader.persistent()
    (a recorded plan keeps the pointers it was given)."""
    cp = cupy()
    dev = int(cp.cuda.Device().id)
    spaces, counts = _cm_workspace.setdefault(dev, []), _cm_counters.setdefault(dev, [])
    with persistent():
        if not spaces or spaces[-1].size < floats:
            spaces.append(cp.empty((max(floats, 1 << 20),), dtype=cp.float32))
        if not counts or counts[-1].size < tickets:
            counts.append(cp.zeros((max(tickets, 4096),), dtype=cp.uint32))
    return spaces[-1], counts[-1]


_sm_count: dict[int, int] = {}  # device -> multiprocessors
_optin_limit: dict[int, int] = {}  # device -> the most shared memory a block may opt in to (bytes)




def _device_attr(cache: dict[int, int], name: str) -> int:
    """CuPy's device attribute ``name`` of the current device, looked up once per device into ``cache``."""
    dev = int(cupy().cuda.Device().id)
    if dev not in cache:
        cache[dev] = int(cupy().cuda.Device(dev).attributes[name])
    return cache[dev]


def _verify_variant(fmt: str, tiles: int, out_dim: int = 0, in_dim: int = 0) -> str:
    """The kernel variant a launch of more than one row with ``tiles`` MMA column tiles takes for a weight [out_dim,
    in_dim]: WGMMA's on sm_90 for the shapes WGMMA_MIN_IN / WGMMA_MIN_OUT admit, else WIDE_SMALL's for 0 < out_dim
    <= WIDE_SMALL_OUT, else WIDE's, or where that is a staged kernel whose shared memory this device cannot give a
    block, WIDE_FALLBACK's ("" = gemv_mma)."""
    preferred = WGMMA.get(fmt, {}).get(min(tiles, 8))
    if preferred is not None and (in_dim >= WGMMA_MIN_IN or out_dim >= WGMMA_MIN_OUT) and wgmma_available():
        return preferred
    variant = WIDE.get(fmt, {}).get(min(tiles, 8), "")
    if 0 < out_dim <= WIDE_SMALL_OUT:
        variant = WIDE_SMALL.get(fmt, {}).get(min(tiles, 8), variant)
    if is_staged(variant):
        mt, ntb, stages = staged_shape(variant)
        need = staged_smem_bytes(fmt, mt, ntb, stages) + staged_static_bytes(ntb)
        if need > _device_attr(_optin_limit, "MaxSharedMemoryPerBlockOptin"):
            return WIDE_FALLBACK.get(fmt, {}).get(min(tiles, 8), "")
    return variant




def _staged_grid(fmt: str, mt: int, ntb: int, stages: int, out_dim: int, tiles: int) -> tuple[int, int]:
    """Grid of a staged launch: (token blocks, G row-block workers); G is the row block count, or where PERSISTENT
    says so about one wave of resident blocks (each takes row blocks y, y + G, ...; cuda/gemv.cu gemv_mma_staged)."""
    token_blocks = -(-tiles // ntb)
    row_blocks = -(-out_dim // (ROWS_PER_BLOCK * mt))
    if ntb < PERSISTENT.get(fmt, 99):
        return token_blocks, row_blocks
    sms = _device_attr(_sm_count, "MultiProcessorCount")
    per_sm = max(1, min(2, SMEM_LIMIT // (staged_smem_bytes(fmt, mt, ntb, stages) + staged_static_bytes(ntb) + 2048)))
    # (blocks whose shared memory fits an SM's 228 KB, with the driver's 1 KB a block; the registers may allow fewer)
    return token_blocks, min(row_blocks, max(1, -(-sms * per_sm // token_blocks)))


def _launch_mma(fmt: str, out_dim: int, xs: Any, out: Any, args: tuple[Any, ...], variant: str = "",
                glu: bool = False, split: str | None = None) -> Any:
    """One v2 launch reading xs [T, P, in]; returns y [T, out] float32, or with ``glu`` silu(gate)·up [T, out/2]
    float32 (``split`` None) or the next GEMV's operand [T, P', out/2] uint16 (``split`` a PREP_KIND value)."""
    num_rows, parts, in_dim = xs.shape
    y, xs_out, result = _glu_outputs(num_rows, out_dim, out, glu, split)
    tpt = 8 // parts
    tiles = -(-num_rows // tpt)
    if not variant and num_rows > 1:  # decode (one row) always takes gemv_mma
        variant = _verify_variant(fmt, tiles, out_dim, in_dim)
    elif variant == ONE_TILE:  # bench and tests: the one-tile kernel (gemv_mma) whatever the row count
        variant = ""
    smem = 0
    smem_limit = 0  # the dynamic shared memory the kernel is opted in to (loader.raise_smem_limit; 0: smem)
    tail_args: tuple[Any, ...] = (NULL, *_NO_CONV)  # counter, tail, conv_w, conv_channels, taps
    if variant.startswith("_w") and not is_cm(variant):  # gemv_mma_wide: "_w<MT>n<NTB>", MT row tiles a warp
        if variant not in WIDE_VARIANTS:
            raise ValueError(f"unknown wide GEMV variant {variant!r}: expected one of {WIDE_VARIANTS}")
        mt, ntb = int(variant[2]), int(variant[4:])
        grid = (-(-out_dim // (ROWS_PER_BLOCK * mt)), -(-tiles // ntb))
    elif is_staged(variant):  # gemv_mma_staged: "_p<MT>n<NTB>s<S>"; token blocks first (cuda/gemv.cu)
        if variant not in STAGED_VARIANTS.get(fmt, ()):
            raise ValueError(f"unknown staged GEMV variant {variant!r} for {fmt}: expected one of "
                             f"{STAGED_VARIANTS.get(fmt, ())}")
        mt, ntb, stages = staged_shape(variant)
        grid = _staged_grid(fmt, mt, ntb, stages, out_dim, tiles)
        smem = staged_smem_bytes(fmt, mt, ntb, stages)
    elif is_cm(variant):  # gemv_mma_wg: "_wg<NTB>s<S>[g<CG>]"; CG is passed in `taps`, the workspace in `tail`
        ntb, stages, groups = cm_shape(variant)
        variant = f"_wg{ntb}s{stages}"
        if variant not in CM_VARIANTS.get(fmt, ()) or groups not in (0, 1, 2, 4, 8):
            raise ValueError(f"unknown warpgroup GEMV variant {variant!r} for {fmt}: expected one of "
                             f"{CM_VARIANTS.get(fmt, ())}, optionally with g1, g2, g4 or g8")
        if not wgmma_available():
            raise ValueError(f"{variant}: the warpgroup kernels need an sm_90 GPU")
        token_blocks, row_blocks = -(-tiles // ntb), -(-out_dim // CM_ROWS)
        groups = groups or cm_groups(out_dim, token_blocks)
        grid = (token_blocks, row_blocks * groups)
        smem = cm_smem_bytes(fmt, ntb, stages, groups)
        smem_limit = cm_smem_bytes(fmt, ntb, stages, 1)  # the most any class-group count takes (the fold)
        space, tickets = NULL, NULL
        if groups > 1:
            space, tickets = _cm_buffers(token_blocks * row_blocks * 64 * ntb * 128, token_blocks * row_blocks)
        tail_args = (tickets, space, NULL, i32(0), i32(groups))
    else:
        ntb = 1 if tiles == 1 else 2 if tiles == 2 else 4
        grid = (-(-out_dim // ROWS_PER_BLOCK), -(-tiles // ntb))
        if variant and (ntb != 1 or glu):
            raise ValueError("kernel variants exist for one MMA column tile (and fp32 output) only")
        variant = f"_n{ntb}{variant}"
    name = f"gemv_mma_{fmt}{variant}{'_glu' if glu else ''}"
    fn = kernel("gemv", name)
    if smem:
        raise_smem_limit(fn, smem_limit or smem)
    fn(grid, (THREADS,), (*args, xs, y, i32(out_dim), i32(in_dim), i32(num_rows), NULL, NULL, NULL, f32(0.0), xs_out,
                          i32(SPLIT_CODE[split]), *tail_args), shared_mem=smem)
    return result


_NO_CONV = (NULL, NULL, i32(0), i32(0))  # the conv epilogue's arguments, unused


def _glu_outputs(num_rows: int, out_dim: int, out: Any, glu: bool, split: str | None) -> tuple[Any, Any, Any]:
    """(y, xs_out, result) of a v2 launch: fp32 y [T, out]; with glu fp32 [T, out/2] or split [T, P, out/2]."""
    if not glu:
        if split is not None:
            raise ValueError("split output needs the glu epilogue")
        y = out_or_new("out", out, (num_rows, out_dim))
        return y, NULL, y
    width = out_dim // 2
    if split is None:
        y = out_or_new("out", out, (num_rows, width))
        return y, NULL, y
    xs_out = split_operand(split, out, num_rows, width)
    return NULL, xs_out, xs_out


def _check_x(x: Any, in_dim: int) -> None:
    require("x", x, np.float32, (None, in_dim))
    if x.shape[0] < 1:
        raise ValueError("x: needs at least one row")


class _CudaLinear:
    """Shared verbs: ``matmul(x)`` (v2 = prepare + tensor-core kernel when ``in`` allows, else v1),
    ``matmul_prepared(xs)`` (v2 only; xs from ``prepare(x, self.prep_kind)``), ``splits`` (row counts of the
    projections a concatenated Linear holds, see ``concat``)."""

    fmt = ""
    shape: tuple[int, int] = (0, 0)
    bytes_per_use = 0
    splits: tuple[int, ...] = ()
    glu = 0  # F for a glu_pair Linear (gate and up rows interleaved in 8-row groups), else 0
    tiled = False  # weight codes stored tile-major (the tensor-core kernels' layout, ``_tile``)
    paired = False  # NVFP4 codes stored in the pair layout (``_pair_layout``; the tensor-core kernels decode it)
    _row_dtype: Any = None
    _row_bytes = 0

    @property
    def prep_kind(self) -> str | None:
        """The xs layout the v2 kernel reads, or None when this shape takes the v1 kernel."""
        return PREP_KIND[self.fmt] if self.shape[1] % (4 * MMA_E[self.fmt]) == 0 else None

    def _v1_args(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _v2_args(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _store(self, rows: Any) -> Any:
        """The weight codes as this Linear keeps them when the shape has a tensor-core path: tile-major (``_tile``),
        NVFP4 words first put in the pair layout (``_pair_layout``); else rows [out, ...] as given (the v1 kernels
        read rows)."""
        self._row_dtype, self._row_bytes = rows.dtype, int(rows.nbytes // max(1, rows.shape[0]))
        self.tiled = self.shape[1] % (4 * MMA_E[self.fmt]) == 0
        self.paired = self.fmt == "nvfp4" and self.tiled
        if self.paired:
            rows = _pair_layout(rows.view(np.uint32)).view(np.uint8)
        if self.tiled:
            return _tile(rows)
        return rows

    def _rows(self, stored: Any) -> Any:
        """The weight codes as rows [out, ...] as the checkpoint packs them (a new array when stored tile-major or
        in the pair layout)."""
        if self.tiled:
            stored = _untile(stored, self.shape[0], self._row_bytes, self._row_dtype)
        if self.paired:
            return _pair_unlayout(stored.view(np.uint32)).view(np.uint8)
        return stored

    def matmul(self, x: Any, out: Any = None, split: str | None = None) -> Any:
        """y = x · Wᵀ. Args: x [T, in] float32 (device), T ≥ 1. Returns: [T, out] float32 (a ``glu_pair``
        Linear: its activation, as ``matmul_prepared``, with ``split``). Raises: ValueError."""
        _check_x(x, self.shape[1])
        kind = self.prep_kind
        if kind is None:
            return _launch(self.fmt, self.shape[0], x, out, self._v1_args())
        return self.matmul_prepared(prepare(x, kind), out, split=split)

    def matmul_prepared(self, xs: Any, out: Any = None, variant: str = "", split: str | None = None) -> Any:
        """y = x · Wᵀ from xs [T, P, in] uint16 = prepare(x, self.prep_kind). Returns [T, out] float32; a
        ``glu_pair`` Linear returns silu(gate) · up: [T, out/2] float32, or with ``split`` (a PREP_KIND value)
        the next GEMV's operand [T, P', out/2] uint16. ``variant`` (bench/gemv.py only): a tuning variant of the
        one-tile kernel, e.g. "_u8". Raises ValueError (bad xs, no tensor-core path, split without glu)."""
        kind = self.prep_kind
        if kind is None:
            raise ValueError(f"{self.fmt} GEMV of in = {self.shape[1]} has no tensor-core path")
        require("xs", xs, np.uint16, (None, PARTS[kind], self.shape[1]))
        return _launch_mma(self.fmt, self.shape[0], xs, out, self._v2_args(), variant, self.glu > 0, split)

    def matmul_residual_norm(self, xs: Any, resid: Any, norm_w: Any, eps: float, split: str | None = None,
                             normed_out: Any = None, out: Any = None) -> Any:
        """T ≤ ``resnorm_rows()`` rows (a decode row, or a small verify's): resid += x · Wᵀ (in place), then the
        RMSNorm of each updated row, in ONE launch (cuda/gemv.cu MMA_Y_RESNORM: each block adds its rows and writes its
        tile's sums of squares, the last T · ceil(out / 256) blocks to finish norm 256 columns of one row each), with
        the bits of ``matmul_prepared`` then add_rms_norm(resid, y, norm_w, eps, split=split).

        Args: xs [T, P, in] uint16 = prepare(x, self.prep_kind); resid [T, out] float32 (the residual stream,
        updated in place); norm_w [out] float32 (1 + w); split: the next GEMV's operand kind (PREP_KIND value) or
        None for fp32; normed_out: optional [T, out] float32 that also receives the fp32 normed rows; out: optional
        result buffer. Returns: xs_next [T, P', out] uint16 (split) or the normed rows [T, out] float32.
        Raises: ValueError on bad shapes / dtypes, T outside 1..resnorm_rows(), out > 16 · RESNORM_SLOTS, or a
        Linear without a tensor-core path. (T rows past the slots, T · tiles > RESNORM_SLOTS, take the unfused
        launches, as a device too small for the waiting blocks does.)
        """
        kind = self.prep_kind
        if kind is None:
            raise ValueError(f"{self.fmt} GEMV of in = {self.shape[1]} has no tensor-core path")
        out_dim, in_dim = self.shape
        rows = int(xs.shape[0]) if getattr(xs, "ndim", 0) == 3 else 0
        if not 1 <= rows <= self.resnorm_rows():
            raise ValueError(f"residual + norm GEMV: xs {tuple(getattr(xs, 'shape', ()))} needs 1 to "
                             f"{self.resnorm_rows()} rows (one MMA column tile)")
        tiles = -(-out_dim // ROWS_PER_BLOCK)
        if tiles > RESNORM_SLOTS:
            raise ValueError(f"residual + norm GEMV of out = {out_dim}: at most {16 * RESNORM_SLOTS} rows")
        require("xs", xs, np.uint16, (rows, PARTS[kind], in_dim))
        require("resid", resid, np.float32, (rows, out_dim))
        require("norm_w", norm_w, np.float32, (out_dim,))
        if normed_out is not None:
            require("normed_out", normed_out, np.float32, (rows, out_dim))
        norming = rows * -(-out_dim // THREADS)  # blocks that wait for the others (cuda/gemv.cu resnorm_tail)
        if norming > min(tiles, 2 * _device_attr(_sm_count, "MultiProcessorCount")) or tiles * rows > RESNORM_SLOTS:
            return self._residual_norm_unfused(xs, resid, norm_w, eps, split, normed_out, out)
        if split is None:
            y = out_or_new("out", out, (rows, out_dim))
            xs_out, result = NULL, y
        else:
            y, xs_out = NULL, split_operand(split, out, rows, out_dim)
            result = xs_out
        name = f"gemv_mma_{self.fmt}_n1_resnorm{'_rows' if rows > 1 else ''}{'_pf' if self.fmt in RESNORM_PF else ''}"
        kernel("gemv", name)(
            (tiles, 1), (THREADS,),
            (*self._v2_args(), xs, y, i32(out_dim), i32(in_dim), i32(rows), resid, norm_w,
             normed_out if normed_out is not None else NULL, f32(eps), xs_out, i32(SPLIT_CODE[split]),
             _counter(tiles), *_NO_CONV))
        return result

    def resnorm_rows(self) -> int:
        """The most rows ``matmul_residual_norm`` takes in one launch: the tokens of one MMA column tile (8 // P: 4 for
        the fp16 operand kinds, 2 for bf16); 0 without a tensor-core path."""
        kind = self.prep_kind
        return 0 if kind is None else 8 // PARTS[kind]

    def _residual_norm_unfused(self, xs: Any, resid: Any, norm_w: Any, eps: float, split: str | None,
                               normed_out: Any, out: Any) -> Any:
        """``matmul_residual_norm`` as separate launches with its bits: ``matmul_prepared``, then add_rms_norm (and
        ``prepare`` of the fp32 normed rows when both ``normed_out`` and ``split`` are wanted). For devices too small
        for the fused tail: its norming blocks (T · ceil(out / 256)) wait for the blocks still to count, which need
        free room, so the fused launch is taken only while they number at most twice the multiprocessors (every
        residual + norm kernel holds ≥ 2 blocks an SM), and no more than the launch's blocks; and for rows whose tile
        slots do not fit (T · tiles > RESNORM_SLOTS)."""
        rows, out_dim = int(xs.shape[0]), self.shape[0]
        y = self.matmul_prepared(xs)
        if normed_out is None:
            return add_rms_norm(resid, y, norm_w, eps, out=out, split=split)
        add_rms_norm(resid, y, norm_w, eps, out=normed_out)
        if split is not None:
            return prepare(normed_out, split, out=split_operand(split, out, rows, out_dim))
        result = out_or_new("out", out, (rows, out_dim))
        result[...] = normed_out
        return result

    def matmul_conv(self, xs: Any, tail: Any, conv_w: Any, out: Any = None) -> Any:
        """One decode row of a GDN layer's fused in-projection (rows: the C conv channels first, then z, a, b)
        with the causal conv + SiLU in the epilogue (cuda/gemv.cu MMA_Y_CONV): y[:C] = silu(conv([tail; row])) and
        the tail shifted in place, with the bits of ``matmul_prepared`` then gdn_seq.gdn_decode's conv launch.

        Args: xs [1, P, in] uint16 = prepare(x, self.prep_kind); tail [K-1, C] float32 (updated in place);
        conv_w [C, K] float32, 2 ≤ K; out: optional [1, out] float32. Returns: y [1, out] float32 (u | z | a | b).
        Raises: ValueError on bad shapes / dtypes, C > out, or a Linear without a tensor-core path.
        """
        kind = self.prep_kind
        if kind is None:
            raise ValueError(f"{self.fmt} GEMV of in = {self.shape[1]} has no tensor-core path")
        out_dim, in_dim = self.shape
        require("xs", xs, np.uint16, (1, PARTS[kind], in_dim))
        require("conv_w", conv_w, np.float32, (None, None))
        channels, taps = (int(n) for n in conv_w.shape)
        require("tail", tail, np.float32, (taps - 1, channels))
        if taps < 2 or channels > out_dim:
            raise ValueError(f"conv_w [{channels}, {taps}]: needs 2 ≤ K and C ≤ out = {out_dim}")
        y = out_or_new("out", out, (1, out_dim))
        kernel("gemv", f"gemv_mma_{self.fmt}_n1_conv")(
            (-(-out_dim // ROWS_PER_BLOCK), 1), (THREADS,),
            (*self._v2_args(), xs, y, i32(out_dim), i32(in_dim), i32(1), NULL, NULL, NULL, f32(0.0), NULL, i32(0),
             NULL, tail, conv_w, i32(channels), i32(taps)))
        return y


_counters: dict[tuple[int, int], Any] = {}
RESNORM_SLOT0 = 32  # cuda/gemv.cu RESNORM_SLOT0: the word where the tile slots start
RESNORM_SLOTS = 8192  # tile slots of a residual + norm launch: T rows · 16-row tiles (out ≤ 131072 at one row)


def _counter(tiles: int) -> Any:
    """The buffer a residual-norm launch of ``tiles`` blocks counts its blocks in: uint32 [RESNORM_SLOT0 +
    RESNORM_SLOTS]; words 0-1 a 64-bit count of the blocks done over every launch on it (cuda/gemv.cu resnorm_tail,
    RESNORM_EPOCH: never reset, so it must only ever be used by launches of ``tiles`` blocks: one buffer per tile count
    and device), its tiles' sums of squares (fp32; T rows: slot t · tiles + tile) from word RESNORM_SLOT0 on. Launches
    on one stream run one after
    another. Allocated zeroed once (a recorded launch plan holds its address)."""
    cp = cupy()
    key = (int(cp.cuda.Device().id), int(tiles))
    c = _counters.get(key)
    if c is None:
        with persistent():
            c = _counters[key] = cp.zeros((RESNORM_SLOT0 + RESNORM_SLOTS,), dtype=cp.uint32)
    return c


class CudaDenseLinear(_CudaLinear):
    """BF16 weight W [out, in] on the device (uint16 bits), in % 8 == 0; stored tile-major (``_tile``) when in % 32
    == 0 (the tensor-core path), else row-major."""

    fmt = "bf16"

    def __init__(self, bits: Any) -> None:
        """Args: bits [out, in] uint16 (BF16), NumPy or CuPy. Raises ValueError on a bad dtype / shape."""
        cp = cupy()
        rows = cp.ascontiguousarray(cp.asarray(bits))
        require("bits", rows, np.uint16, (None, None))
        out_dim, in_dim = rows.shape
        if in_dim % 8:
            raise ValueError(f"BF16 GEMV needs in % 8 == 0 (16-byte rows), got in = {in_dim}")
        self.shape = (int(out_dim), int(in_dim))
        self.bytes_per_use = int(rows.nbytes)
        self.bits = self._store(rows)

    def rows(self) -> Any:
        """W [out, in] uint16 (BF16 bits), row-major (a copy when stored tile-major)."""
        return self._rows(self.bits)

    def _v1_args(self) -> tuple[Any, ...]:
        return (self.bits,)

    def _v2_args(self) -> tuple[Any, ...]:
        return (self.bits, NULL, NULL)


class CudaFP8BlockLinear(_CudaLinear):
    """FP8 E4M3 weight [out, in] with 128×128 block scales [ceil(out/128), ceil(in/128)] fp32 (multiplied); codes
    stored tile-major (``_tile``) when in % 64 == 0, else row-major."""

    fmt = "fp8"

    def __init__(self, codes: Any, scale: Any, scale8: Any = None) -> None:
        """Args: codes [out, in] uint8; scale float32 grid (or None with ``scale8``: the grid expanded to one row
        per 8 output rows, [ceil(out/8), ceil(in/128)], as ``concat`` / ``glu_pair`` build). Raises ValueError."""
        cp = cupy()
        rows = cp.ascontiguousarray(cp.asarray(codes))
        require("codes", rows, np.uint8, (None, None))
        out_dim, in_dim = rows.shape
        if in_dim % 16:
            raise ValueError(f"FP8 GEMV needs in % 16 == 0 (16-byte rows), got in = {in_dim}")
        cols = -(-in_dim // 128)
        if scale is not None:
            self.scale = cp.ascontiguousarray(cp.asarray(scale, dtype=cp.float32))
            require("scale", self.scale, np.float32, (-(-out_dim // 128), cols))
            self.scale8 = cp.ascontiguousarray(cp.repeat(self.scale, 16, axis=0)[:-(-out_dim // 8)])
        else:
            self.scale = None
            self.scale8 = cp.ascontiguousarray(cp.asarray(scale8, dtype=cp.float32))
            require("scale8", self.scale8, np.float32, (-(-out_dim // 8), cols))
        self.shape = (int(out_dim), int(in_dim))
        self.bytes_per_use = int(rows.nbytes + (self.scale.nbytes if self.scale is not None
                                                else self.scale8.nbytes // 16))
        self.codes = self._store(rows)

    def rows(self) -> Any:
        """The E4M3 codes [out, in] uint8, row-major (a copy when stored tile-major)."""
        return self._rows(self.codes)

    @property
    def prep_kind(self) -> str | None:
        kind = super().prep_kind
        if kind is None and self.scale is None:
            raise ValueError("a concatenated FP8 Linear needs in % 64 == 0")
        return kind

    def _v1_args(self) -> tuple[Any, ...]:
        return (self.codes, self.scale)

    def _v2_args(self) -> tuple[Any, ...]:
        return (self.codes, self.scale8, NULL)


class CudaNVFP4Linear(_CudaLinear):
    """NVFP4 weight: packed E2M1 [out, in/2] (low nibble first; when in % 128 == 0 stored tile-major, ``_tile``,
    with each 32-bit word's nibbles in the pair layout, ``_pair_layout``), E4M3 scales [out, in/16] (when in % 128
    == 0 stored tile-major too, ``_tile_scales``; ``scale_codes`` gives them back row-major), fp32 global scale."""

    fmt = "nvfp4"

    def __init__(self, packed: Any, scale_codes: Any, global_scale: float, divide: bool = False,
                 row_scale: Any = None) -> None:
        """Args: packed uint8; scale_codes uint8 (E4M3 bits); global_scale (a divisor with ``divide``, the
        compressed-tensors convention); row_scale: per-row fp32 output multipliers (``concat`` passes them; then
        global_scale is ignored and only the v2 path exists). Raises ValueError on bad dtypes / shapes or
        in % 32 != 0."""
        cp = cupy()
        rows = cp.ascontiguousarray(cp.asarray(packed))
        require("packed", rows, np.uint8, (None, None))
        out_dim, half = rows.shape
        in_dim = 2 * half
        if in_dim % 32:
            raise ValueError(f"NVFP4 GEMV needs in % 32 == 0 (16-byte rows), got in = {in_dim}")
        codes = cp.ascontiguousarray(cp.asarray(scale_codes))
        require("scale_codes", codes, np.uint8, (out_dim, in_dim // 16))
        self.global_scale = float(np.float32(global_scale))
        self.divide = bool(divide)
        if row_scale is None:
            g = np.float32(self.global_scale)
            mult = np.float32(16384.0) / g if self.divide else np.float32(16384.0) * g
            row_scale = cp.full((out_dim,), mult, dtype=cp.float32)
            self.concatenated = False
        else:
            self.concatenated = True
        self.row_scale = cp.ascontiguousarray(cp.asarray(row_scale, dtype=cp.float32))
        require("row_scale", self.row_scale, np.float32, (out_dim,))
        self.shape = (int(out_dim), int(in_dim))
        self.bytes_per_use = int(rows.nbytes + codes.nbytes + 4)
        self.packed = self._store(rows)
        self.scales = _tile_scales(codes) if self.tiled else codes  # the kernels' layout

    @property
    def scale_codes(self) -> Any:
        """The E4M3 scale codes [out, in/16] uint8, row-major as the checkpoint has them (a copy when stored
        tile-major)."""
        if self.tiled:
            return _untile_scales(self.scales, self.shape[0], self.shape[1] // 16)
        return self.scales

    def rows(self) -> Any:
        """The packed E2M1 codes [out, in/2] uint8, row-major, low nibble first (a copy when stored tile-major in
        the pair layout)."""
        return self._rows(self.packed)

    @property
    def prep_kind(self) -> str | None:
        kind = super().prep_kind
        if kind is None and self.concatenated:
            raise ValueError("a concatenated NVFP4 Linear needs in % 128 == 0")
        return kind

    def _v1_args(self) -> tuple[Any, ...]:
        return (self.packed, self.scales.view(np.uint16), f32(self.global_scale), i32(int(self.divide)))

    def _v2_args(self) -> tuple[Any, ...]:
        return (self.packed, self.scales.view(np.uint16), self.row_scale)


CudaLinear = CudaDenseLinear | CudaFP8BlockLinear | CudaNVFP4Linear


def concat(parts: list[Any]) -> Any:
    """One device Linear holding the rows of ``parts`` (same format and ``in``) one after another, so projections
    of the same input run in one launch; ``splits`` gives each part's row count.

    Raises ValueError if the formats or ``in`` differ, the shape has no tensor-core path, or (FP8) a part's row
    count is not a multiple of 8 (its block scales could not be expanded per 8 rows).
    """
    cp = cupy()
    first = parts[0]
    if any(type(p) is not type(first) or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("concat: parts must share one format and one input size")
    if first.shape[1] % (4 * MMA_E[first.fmt]):
        raise ValueError(f"concat: {first.fmt} in = {first.shape[1]} has no tensor-core path")
    if isinstance(first, CudaDenseLinear):
        out: Any = CudaDenseLinear(cp.concatenate([p.rows() for p in parts]))
    elif isinstance(first, CudaFP8BlockLinear):
        if any(p.shape[0] % 8 for p in parts[:-1]):
            raise ValueError("concat: FP8 parts need row counts that are multiples of 8")
        out = CudaFP8BlockLinear(cp.concatenate([p.rows() for p in parts]), None,
                                 scale8=cp.concatenate([p.scale8 for p in parts]))
    else:
        out = CudaNVFP4Linear(cp.concatenate([p.rows() for p in parts]), cp.concatenate([p.scale_codes for p in parts]),
                              1.0, row_scale=cp.concatenate([p.row_scale for p in parts]))
    out.splits = tuple(p.shape[0] for p in parts)
    return out


def glu_pair(gate: Any, up: Any) -> Any:
    """One device Linear for the MLP's gate and up projections whose GEMV applies silu(gate) · up in its epilogue
    (cuda/gemv.cu MMA_Y_GLU): rows interleaved in 8-row groups (gate rows 8b..8b+7, then up rows 8b..8b+7), so
    ``matmul_prepared`` returns the activation [T, F] (or the down projection's operand) in
    one launch, with the bits of silu_mul_rows over ``concat([gate, up])``. ``glu`` = F.

    Args: gate, up: device Linears [F, in] of one format with a tensor-core path. Raises ValueError if the formats
    or shapes differ, F % 8 != 0, or ``in`` has no tensor-core path.
    """
    cp = cupy()
    if type(gate) is not type(up) or gate.shape != up.shape:
        raise ValueError("glu_pair: gate and up must share one format and shape")
    width, in_dim = gate.shape
    if width % 8:
        raise ValueError(f"glu_pair: needs F % 8 == 0, got {width}")
    if in_dim % (4 * MMA_E[gate.fmt]):
        raise ValueError(f"glu_pair: {gate.fmt} in = {in_dim} has no tensor-core path")

    def mix(a: Any, b: Any) -> Any:  # [F, ...] x 2 -> [2F, ...] in 8-row groups a, b, a, b, ...
        rest = tuple(int(n) for n in a.shape[1:])
        both = cp.stack([a.reshape((width // 8, 8) + rest), b.reshape((width // 8, 8) + rest)], axis=1)
        return cp.ascontiguousarray(both.reshape((2 * width,) + rest))

    if isinstance(gate, CudaDenseLinear):
        out: Any = CudaDenseLinear(mix(gate.rows(), up.rows()))
    elif isinstance(gate, CudaFP8BlockLinear):
        out = CudaFP8BlockLinear(mix(gate.rows(), up.rows()), None,
                                 scale8=cp.stack([gate.scale8, up.scale8], axis=1).reshape(2 * width // 8, -1))
    else:
        out = CudaNVFP4Linear(mix(gate.rows(), up.rows()), mix(gate.scale_codes, up.scale_codes), 1.0,
                              row_scale=mix(gate.row_scale, up.row_scale))
    out.glu = int(width)
    out.splits = (int(width), int(width))
    return out


def reference_bf16(bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 x · f32(bits)ᵀ. bits [out, in] uint16, x [T, in] float32 -> [T, out] float64."""
    return np.asarray(x, np.float64) @ bf16_to_f32(bits).astype(np.float64).T


def reference_fp8(codes: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 x · dequantize_fp8_block(codes, scale)ᵀ -> [T, out] float64."""
    from tandem.dtypes import e4m3_to_f32

    w = dequantize_fp8_block(e4m3_to_f32(codes), scale.astype(np.float32))
    return np.asarray(x, np.float64) @ w.astype(np.float64).T


def reference_nvfp4(packed: np.ndarray, scale_codes: np.ndarray, global_scale: float, x: np.ndarray,
                    divide: bool = False) -> np.ndarray:
    """float64 x · dequantize_nvfp4(packed, scale_codes, global_scale)ᵀ -> [T, out] float64."""
    w = dequantize_nvfp4(packed, scale_codes, global_scale, divide=divide)
    return np.asarray(x, np.float64) @ w.astype(np.float64).T
