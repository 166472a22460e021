"""Clip search: per quantisation group, the multiplier of the group maximum with the least activation-weighted error.

For a weight W [out, in] and the mean square of each input channel over a calibration text, a[j] = E[x_j²], the
expected output error of one row r is Σ_j a[j] · (W[r, j] − Ŵ[r, j])² when the input channels are uncorrelated
(the diagonal of the activation second moment, as AWQ's and GPTQ's cheaper variants use). A group's scale only
changes its own terms, so each group picks its clip independently. Without calibration a = 1 (plain weight MSE)
and the caller usually asks for round-to-nearest (clip 1) instead.

Formats: NVFP4 (group = 16 values of a row), FP8 128×128 blocks (group = block), FP8 per row (group = row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tandem.dtypes import E4M3_MAX, e4m3_to_f32, f32_to_e4m3
from tandem.formats.linear import FP8_BLOCK
from tandem.formats.nvfp4 import NVFP4_GROUP, nvfp4_fake_quant, nvfp4_global_scale, quantize_fp8_rows
from tandem.safetensors_io import Tensor

F32Array = npt.NDArray[np.float32]
F64Array = npt.NDArray[np.float64]

DEFAULT_CLIPS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65)
_ROWS_ELEMS = 1 << 21  # rows are processed in slices of about this many weights to bound memory


@dataclass
class Quantized:
    """One module's stored tensors and the figures of its search.

    Attributes:
        tensors: suffix (`weight`, `weight_scale`, ...) -> (safetensors dtype, stored bits).
        err_rtn, err: activation-weighted squared error Σ a[j]·(W − Ŵ)² with clip 1 and with the chosen clips.
        mean_clip: mean chosen multiplier over groups; num_groups: how many groups.
    """

    tensors: dict[str, Tensor]
    err_rtn: float
    err: float
    mean_clip: float
    num_groups: int


def _weighted_err(w: F32Array, deq: F32Array, act: F64Array) -> F64Array:
    diff = (w - deq).astype(np.float64)
    out: F64Array = diff * diff * act[None, :]
    return out


def quantize_nvfp4_searched(w: F32Array, act: F32Array | None, clips: Sequence[float]) -> Quantized:
    """NVFP4 (ModelOpt layout) with a per-16-block clip search; `clips` = (1.0,) is round-to-nearest.

    Args:
        w: [out, in] float32, in a multiple of 16. act: [in] channel mean squares, or None (weight MSE).
    Returns:
        Quantized with `weight` U8 [out, in/2], `weight_scale` F8_E4M3 [out, in/16], `weight_scale_2` F32 [].
    """
    out_dim, in_dim = w.shape
    a = np.ones(in_dim, np.float64) if act is None else act.astype(np.float64)
    g = nvfp4_global_scale(w)
    packed = np.empty((out_dim, in_dim // 2), np.uint8)
    scales = np.empty((out_dim, in_dim // NVFP4_GROUP), np.uint8)
    err_rtn = err_best = clip_sum = 0.0
    step = max(1, _ROWS_ELEMS // in_dim)
    for r0 in range(0, out_dim, step):
        ws = w[r0:r0 + step]
        best_err = best_clip = None
        for c in clips:
            deq, _, _ = nvfp4_fake_quant(ws, float(c), g)
            e = _weighted_err(ws, deq, a).reshape(ws.shape[0], -1, NVFP4_GROUP).sum(axis=2)
            if c == 1.0:
                err_rtn += float(e.sum())
            if best_err is None or best_clip is None:
                best_err, best_clip = e, np.full(e.shape, c, np.float32)
            else:
                better = e < best_err
                best_err = np.where(better, e, best_err)
                best_clip = np.where(better, np.float32(c), best_clip)
        assert best_err is not None and best_clip is not None
        _, codes, sc = nvfp4_fake_quant(ws, best_clip, g)
        packed[r0:r0 + step] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        scales[r0:r0 + step] = sc
        err_best += float(best_err.sum())
        clip_sum += float(best_clip.sum())
    if 1.0 not in clips:
        err_rtn = float("nan")
    n = scales.size
    return Quantized({"weight": ("U8", packed), "weight_scale": ("F8_E4M3", scales),
                      "weight_scale_2": ("F32", np.array(g, np.float32))}, err_rtn, err_best, clip_sum / n, n)


def _fp8_block_fake(w: F32Array, clip: F32Array | float) -> tuple[F32Array, npt.NDArray[np.uint8], F32Array]:
    """128×128-block FP8 with per-block clip [gr, gc] (or scalar): (dequantized, codes, scale [gr, gc])."""
    out_dim, in_dim = w.shape
    gr, gc = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    pad = np.zeros((gr * FP8_BLOCK, gc * FP8_BLOCK), np.float32)
    pad[:out_dim, :in_dim] = w
    amax = np.abs(pad.reshape(gr, FP8_BLOCK, gc, FP8_BLOCK)).max(axis=(1, 3)) * np.asarray(clip, np.float32)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:out_dim, :in_dim]
    codes = f32_to_e4m3(np.clip(w / expanded, -E4M3_MAX, E4M3_MAX).astype(np.float32))
    return (e4m3_to_f32(codes) * expanded).astype(np.float32), codes, scale


def _block_sum(e: F64Array) -> F64Array:
    out_dim, in_dim = e.shape
    gr, gc = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    pad = np.zeros((gr * FP8_BLOCK, gc * FP8_BLOCK), np.float64)
    pad[:out_dim, :in_dim] = e
    out: F64Array = pad.reshape(gr, FP8_BLOCK, gc, FP8_BLOCK).sum(axis=(1, 3))
    return out


def quantize_fp8_block_searched(w: F32Array, act: F32Array | None, clips: Sequence[float]) -> Quantized:
    """FP8 E4M3 with 128×128 block scales (spec §9 layout, F32 `weight_scale_inv`) and a per-block clip search."""
    a = np.ones(w.shape[1], np.float64) if act is None else act.astype(np.float64)
    errs = {float(c): _block_sum(_weighted_err(w, _fp8_block_fake(w, float(c))[0], a)) for c in clips}
    stack = np.stack([errs[float(c)] for c in clips])
    best = np.argmin(stack, axis=0)
    clip = np.asarray(clips, np.float32)[best]
    _, codes, scale = _fp8_block_fake(w, clip)
    return Quantized({"weight": ("F8_E4M3", codes), "weight_scale_inv": ("F32", scale)},
                     float(errs.get(1.0, np.array(np.nan)).sum()), float(stack.min(axis=0).sum()),
                     float(clip.mean()), int(clip.size))


def quantize_fp8_rows_searched(w: F32Array, act: F32Array | None, clips: Sequence[float]) -> Quantized:
    """FP8 E4M3 with an fp32 scale per row (`weight_scale` [out, 1]) and a per-row clip search (the head)."""
    a = np.ones(w.shape[1], np.float64) if act is None else act.astype(np.float64)
    errs = []
    for c in clips:
        codes, scale = quantize_fp8_rows(w, float(c))
        errs.append(_weighted_err(w, e4m3_to_f32(codes) * scale, a).sum(axis=1))
    stack = np.stack(errs)
    clip = np.asarray(clips, np.float32)[np.argmin(stack, axis=0)][:, None]
    codes, scale = quantize_fp8_rows(w, clip)
    rtn = float(stack[list(clips).index(1.0)].sum()) if 1.0 in clips else float("nan")
    return Quantized({"weight": ("F8_E4M3", codes), "weight_scale": ("F32", scale)}, rtn,
                     float(stack.min(axis=0).sum()), float(clip.mean()), int(clip.size))
