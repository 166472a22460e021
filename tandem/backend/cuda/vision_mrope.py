"""The q / k prep of an image prompt's rows at 3-D rotary positions (kernel: cuda/vision_mrope.cu
``attn_prep_rows_mrope``), for the attention prefills (attention_tree.attention_prefill_step and
attention_flash.attention_flash_prefill take ``mrope=``).

`mrope_prep`: attn_prep_rows (attention_tree.cu) with each row's position from a [T, 3] table (temporal, height,
width; tandem/models/qwen3_5/mrope.py) instead of start + t: q / k RMSNorm, partial RoPE whose frequency f rotates by
the position of its axis in the interleaved layout (``mrope_section``), q to a new [T, H, D] array, the K / V rows
to the caches at dst_row0 + t in the caches' storage. A row with its three positions equal (every text token) runs
the text prep's own device function at that position (attention_common.cuh norm_rope_head), so its bits are those
of attn_prep_rows there (tests/test_cuda_vision_mrope.py checks this bit for bit): the text before a prompt's first
image keeps a text-only prompt's bits, which is what lets the prefix cache share those rows.

Reference (`reference`): numpy_ops.rms_norm, numpy_ops.mrope_tables and numpy_ops.apply_rope, as
Qwen3_5Model.attention_qkv with [T, 3] positions; relative error ≤ 1e-5 (cosf / sinf against NumPy's).
`reference_prefill`: the whole attention layer of such rows (attention_tree.reference_prefill with 3-D positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.cuda.arrays import f32, i32, kv_suffix, require
from tandem.backend.cuda.attention_args import attention_shapes
from tandem.backend.cuda.loader import cupy, kernel
from tandem.backend.kv_rows import read_rows, write_rows

KERNELS = ("attn_prep_rows_mrope##SUF",)
THREADS = 256
PREP_HEADS = THREADS // 32  # one warp per (row, head)


@dataclass(frozen=True)
class MRopeRows:
    """The rotary positions of T rows of a prefill call on the device.

    Attributes: positions: [T, 3] int32 (device, C-contiguous): (temporal, height, width) a row.
        section: ``mrope_section`` (three ints: the frequencies each axis takes, mrope.py).
    """

    positions: Any
    section: tuple[int, int, int]

    @classmethod
    def upload(cls, positions: np.ndarray, section: Sequence[int]) -> "MRopeRows":
        """Rows from host positions [T, 3] (any integer dtype). Raises: ValueError (a shape or a value out of int32,
        a section not of three ints)."""
        pos = np.asarray(positions)
        if pos.ndim != 2 or pos.shape[1] != 3 or pos.shape[0] < 1:
            raise ValueError(f"positions: expected [T ≥ 1, 3], got {list(pos.shape)}")
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= 2 ** 31):
            raise ValueError("positions: outside [0, 2^31)")
        sec = tuple(int(s) for s in section)
        if len(sec) != 3:
            raise ValueError(f"section: expected three ints, got {list(section)}")
        return cls(cupy().asarray(np.ascontiguousarray(pos, dtype=np.int32)), (sec[0], sec[1], sec[2]))


def mrope_prep(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, rows: MRopeRows,
               k_dst: Any, v_dst: Any, dst_row0: int, eps: float) -> Any:
    """Norm and rotate T rows at their 3-D positions; write their K / V rows.

    Args: qg [T, H, 2D], k_new / v_new [T, Hkv, D], q_norm / k_norm [D], inv_freq [rd/2] float32 (device); rows:
    ``MRopeRows`` of T rows; k_dst / v_dst [max_len, Hkv, D] float32 or uint16 (bf16 bits), rows dst_row0.. written
    (normed and rotated k as stored; v as stored); dst_row0 ≥ 0; eps.
    Returns: q [T, H, D] float32 (device), normed and rotated.
    Raises: ValueError on bad shapes / dtypes, or rows past the destination.
    """
    t, h, hkv, d, rd, max_len = attention_shapes(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_dst, v_dst)
    require("positions", rows.positions, np.int32, (t, 3))
    if not 0 <= dst_row0 or dst_row0 + t > max_len:
        raise ValueError(f"{t} rows at {dst_row0} outside the cache of {max_len} rows")
    q = cupy().empty((t, h, d), dtype=np.float32)
    kernel("vision_mrope", "attn_prep_rows_mrope" + kv_suffix(k_dst))(
        (-(-(h + hkv) // PREP_HEADS), t), (THREADS,),
        (qg, k_new, v_new, q_norm, k_norm, inv_freq, rows.positions, i32(rows.section[1]), i32(rows.section[2]), q,
         k_dst, v_dst, i32(h), i32(hkv), i32(d), i32(rd), i32(dst_row0), f32(eps)))
    return q


def reference(qg: np.ndarray, k_new: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, positions: np.ndarray,
              rotary_dim: int, theta: float, section: Sequence[int], eps: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [T, H, D], k [T, Hkv, D] (normed, rotated at positions [T, 3]) and the gate [T, H·D], float32: the host
    model's attention_qkv after its projections (Qwen3_5Model.attention_qkv)."""
    d = qg.shape[2] // 2
    q = numpy_ops.rms_norm(qg[:, :, :d], q_norm, eps)
    k = numpy_ops.rms_norm(k_new, k_norm, eps)
    cos, sin = numpy_ops.mrope_tables(np.asarray(positions, dtype=np.int64), rotary_dim, theta, section)
    numpy_ops.apply_rope(q, cos, sin)
    numpy_ops.apply_rope(k, cos, sin)
    return q, k, qg[:, :, d:].reshape(qg.shape[0], -1)


def reference_prefill(qg: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray,
                      rotary_dim: int, theta: float, section: Sequence[int], positions: np.ndarray,
                      k_cache: np.ndarray, v_cache: np.ndarray, start: int, eps: float) -> np.ndarray:
    """The attention layer of T prompt rows at sequence indices start.. and rotary positions [T, 3] (causal by
    index; caches, float32 or uint16 bf16 bits, written at start..): y [T, H·D] float32, Qwen3_5Model._attention
    with an image prompt's rows."""
    t = qg.shape[0]
    q, k, gate = reference(qg, k_new, q_norm, k_norm, positions, rotary_dim, theta, section, eps)
    write_rows(k_cache, start, k)
    write_rows(v_cache, start, v_new)
    a = numpy_ops.attention_prefill(q, read_rows(k_cache, start + t), read_rows(v_cache, start + t), start)
    return np.asarray(a.reshape(t, -1) * numpy_ops.sigmoid(gate), dtype=np.float32)
