"""Embedding lookup of BF16 rows widened to fp32 on the GPU. Kernel: cuda/embed.cu.

Reference: `reference` = tandem.dtypes.bf16_to_f32 of the gathered rows (exact: a BF16 value is the top half of
its float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel
from tandem.backend.cuda.plan import Relaunch
from tandem.dtypes import bf16_to_f32

KERNELS = ("embed_bf16", "embed_bf16_one", "embed_bf16_one_norm")
THREADS = 256


def embed(bits: Any, ids: Sequence[int], out: Any = None, ids_device: Any = None) -> Any:
    """Rows ``ids`` of the embedding as float32.

    Args: bits [V, E] uint16 (BF16, device); ids: host token ids (checked against V by the caller: the model's
    ``_check_ids``). out: optional [T, E] float32. ids_device: optional int32 device copy of ids (then read from
    it, no upload: a recorded launch plan rewrites it between replays).
    Returns: [T, E] float32 (device). Raises: ValueError on a bad dtype / shape or no ids.
    """
    require("bits", bits, np.uint16, (None, None))
    cols, n = int(bits.shape[1]), len(ids)
    if n < 1:
        raise ValueError("ids: need at least one token")
    y = out_or_new("out", out, (n, cols))
    blocks = -(-cols // THREADS)
    if ids_device is not None:
        require("ids_device", ids_device, np.int32, (n,))
        kernel("embed", "embed_bf16")((blocks, n), (THREADS,), (bits, ids_device, y, i32(cols)))
    elif n == 1:
        kernel("embed", "embed_bf16_one")((blocks,), (THREADS,), (bits, i32(int(ids[0])), y, i32(cols)))
    else:
        dev = cupy().asarray(np.asarray(ids, dtype=np.int32))
        kernel("embed", "embed_bf16")((blocks, n), (THREADS,), (bits, dev, y, i32(cols)))
    return y


def embed_norm(bits: Any, token: int | Any, norm_w: Any, eps: float, x_out: Any, split: str | None = None,
               out: Any = None) -> Any:
    """One decode token: its embedding row into ``x_out`` and that row's RMSNorm as the first projection's
    operand, in one launch (cuda/embed.cu embed_bf16_one_norm; the bits of ``embed`` then rms_norm.rms_norm).

    Args: bits [V, E] uint16 (BF16); token: a host id (checked against V by the caller) or a device int32 array
    [1] holding it (read by the kernel: the previous step's on-device argmax or sampler, so the host need not read
    the id before launching this step; an id outside [0, V), a sampler's -1, reads row 0 and the host raises on
    it); norm_w [E] float32 (1 + w); eps; x_out [1, E] float32 (the residual stream, written); split: the operand
    kind (gemv.PREP_KIND value) or None for fp32; out: optional result buffer.
    Returns: xs [1, P, E] uint16 (split) or the normed row [1, E] float32.
    Raises: ValueError on a bad dtype / shape.
    """
    if isinstance(token, (int, np.integer)):
        by_value, ptr = int(token), None
    else:
        require("token", token, np.int32, (1,))
        by_value, ptr = 0, token
    args, result = _norm_args(bits, by_value, ptr, norm_w, eps, x_out, split, out)
    kernel("embed", "embed_bf16_one_norm")((1,), (THREADS,), args)
    return result


def _norm_args(bits: Any, by_value: int, ptr: Any, norm_w: Any, eps: float, x_out: Any, split: str | None,
               out: Any) -> tuple[tuple[Any, ...], Any]:
    """embed_bf16_one_norm's arguments (index 1: the id by value, 2: the device id's pointer or null) and the
    result array, checked as embed_norm documents."""
    from tandem.backend.cuda.operand import NULL, SPLIT_CODE, split_operand

    require("bits", bits, np.uint16, (None, None))
    cols = int(bits.shape[1])
    require("x_out", x_out, np.float32, (1, cols))
    require("norm_w", norm_w, np.float32, (cols,))
    if split is None:
        y, xs = out_or_new("out", out, (1, cols)), NULL
        result = y
    else:
        y, xs = NULL, split_operand(split, out, 1, cols)
        result = xs
    args = (bits, i32(by_value), NULL if ptr is None else ptr, i32(int(bits.shape[0])), x_out, norm_w, f32(eps), y, xs,
            i32(SPLIT_CODE[split]), i32(cols))
    return args, result


class EmbedNormStep:
    """``embed_norm`` for a launch plan: the checks, the result buffer and the argument block made once; each call
    launches it for a token with little host time (plan.Relaunch: the same kernel and arguments, so the same
    bits; programmatic dependent launch where the device has it: the kernel waits before it reads).

    Args: as embed_norm without the token (bits [V, E] uint16, norm_w [E] float32, eps, x_out [1, E] float32,
    split, out). Call: ``step(token)``, a host id (checked against V by the caller) or a device int32 array [1]
    (the caller keeps it alive until the launch has run). ``result``: xs [1, P, E] uint16 (split) or [1, E] float32.
    Raises: ValueError on a bad dtype / shape (at construction), or a device token that is not int32 [1].
    """

    def __init__(self, bits: Any, norm_w: Any, eps: float, x_out: Any, split: str | None = None,
                 out: Any = None) -> None:
        args, self.result = _norm_args(bits, 0, None, norm_w, eps, x_out, split, out)
        self.keep = args
        self._launch = Relaunch(kernel("embed", "embed_bf16_one_norm"), (1,), (THREADS,), args)

    def __call__(self, token: int | Any) -> None:
        if isinstance(token, (int, np.integer)):
            self._launch.set(1, int(token))
            self._launch.set(2, 0)
        else:
            if token.dtype != np.int32 or token.shape != (1,):
                raise ValueError(f"token: expected an int32 device array [1], got {token.dtype} {token.shape}")
            self._launch.set(1, 0)
            self._launch.set(2, int(token.data.ptr))
        self._launch.launch()


def reference(bits: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """bf16_to_f32(bits[ids]) -> [T, E] float32."""
    return bf16_to_f32(np.asarray(bits)[np.asarray(ids, dtype=np.int64)])
