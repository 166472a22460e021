"""The CUDA Qwen3.5 model's device weights (one dataclass per layer kind) and the helpers that run a device Linear
on an operand: ``_fuse`` / ``_glu`` build the fused projections (gemv.concat, gemv.glu_pair) where the format
allows, ``_kind`` names the split operand a GEMV reads, ``_mm`` runs it, ``_cols`` splits a fused output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.backend.cuda import gemv
from tandem.backend.cuda.operand import split_cols, split_pieces


@dataclass
class _GDN:
    """Device GDN weights: Linears in_qkv [C, E], in_z [Hv·dv, E], in_a/in_b [Hv, E], out [E, Hv·dv];
    conv [C, K], a_log/dt_bias [Hv], norm [dv] float32."""

    in_qkv: Any
    in_z: Any
    in_a: Any
    in_b: Any
    out: Any
    conv: Any
    a_log: Any
    dt_bias: Any
    norm: Any
    proj: Any = None  # in_qkv | in_z | in_a | in_b in one Linear (gemv.concat), when the format allows


@dataclass
class _Attn:
    """Device attention weights: Linears q [2·H·D, E], k/v [Hkv·D, E], o [E, H·D]; q_norm/k_norm [D] float32."""

    q: Any
    k: Any
    v: Any
    o: Any
    q_norm: Any
    k_norm: Any
    proj: Any = None  # q | k | v in one Linear (gemv.concat), when the format allows


@dataclass
class _Layer:
    """One device decoder layer: norms [E] float32 (1 + w), the mixer and the MLP Linears."""

    input_norm: Any
    post_norm: Any
    mixer: _GDN | _Attn
    gate: Any
    up: Any
    down: Any
    gate_up: Any = None  # gate and up in one Linear with the SiLU·mul epilogue (gemv.glu_pair), when the format allows


Mixer = Callable[[int, _Layer, Any], Any]


def _fuse(parts: list[Any]) -> Any:
    """gemv.concat of device Linears that take the tensor-core path, else None (then they run one by one)."""
    if not all(isinstance(p, (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear))
               for p in parts):
        return None
    try:
        return gemv.concat(parts)
    except ValueError:
        return None


def _glu(gate: Any, up: Any) -> Any:
    """gemv.glu_pair of the MLP's gate and up (SiLU·mul in the GEMV's epilogue), else None (they run one by one)."""
    if not all(isinstance(p, (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear))
               for p in (gate, up)) or gate.prep_kind is None:
        return None
    try:
        return gemv.glu_pair(gate, up)
    except ValueError:
        return None


def _kind(lin: Any) -> str | None:
    """The split operand a Linear's tensor-core GEMV reads (gemv.PREP_KIND), or None (it takes fp32 rows)."""
    return getattr(lin, "prep_kind", None) if lin is not None else None


def _mm(lin: Any, a: Any, split: str | None = None, out: Any = None) -> Any:
    """lin's GEMV on an operand: a split xs [T, P, in] uint16 (from a norm / activation kernel) or fp32 [T, in].
    ``split``: a glu_pair's output operand kind; ``out``: an optional result buffer (fp32 results)."""
    if a.dtype == np.uint16:
        return lin.matmul_prepared(a, split=split, out=out)
    if split is not None:
        return lin.matmul(a, split=split, out=out)
    return lin.matmul(a) if out is None else lin.matmul(a, out=out)


def _cols(y: Any, sizes: Sequence[int], outs: Sequence[Any] | None = None) -> list[Any]:
    """Split y [T, sum(sizes)] by columns into C-contiguous pieces: views for T = 1, else one gemv.split_pieces
    launch for all of them (into ``outs[j]`` where given)."""
    if y.shape[0] > 1 and not isinstance(y, np.ndarray) and len(sizes) <= 4:
        return split_pieces(y, sizes, outs)
    out, start = [], 0
    for j, n in enumerate(sizes):
        dst = outs[j] if outs is not None else None
        if y.shape[0] == 1 and dst is None:
            piece = y[0, start:start + n].reshape(1, n)
        elif isinstance(y, np.ndarray):  # the CPU glue test's stand-in arrays
            piece = np.ascontiguousarray(y[:, start:start + n])
            if dst is not None:
                dst[...] = piece
                piece = dst
        else:
            piece = split_cols(y, start, n, out=dst)
        out.append(piece)
        start += n
    return out
