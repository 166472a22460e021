"""Argument checks shared by the launchers: each raises ValueError with the argument's name before a launch.

`unchecked()` turns the checks off for a block of launches whose arguments the caller built itself and has
already checked once (the CUDA model's hot verbs after their first call, `checked_once`): each check costs about a microsecond
of host time, and a decode step launches hundreds of kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda.loader import cupy


_checks = [True]


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Skip `require` inside the block (nesting-safe; restored on exit, also on an exception)."""
    before = _checks[0]
    _checks[0] = False
    try:
        yield
    finally:
        _checks[0] = before


@contextlib.contextmanager
def checked_once(seen: set[str], verb: str) -> Iterator[None]:
    """A block of ``verb``'s launches with every `require` check the first time (``verb`` then joins ``seen``) and
    `unchecked` after: a model's hot verbs build the same arguments at every call."""
    if verb in seen:
        with unchecked():
            yield
        return
    yield
    seen.add(verb)


def require(name: str, arr: Any, dtype: Any, shape: Sequence[int | None], contiguous: bool = True) -> None:
    """Check that `arr` is a CuPy array of `dtype` and `shape` (None: any size), C-contiguous if asked.

    Raises: ValueError naming `name`, the expected and the found dtype / shape (unless inside `unchecked()`).
    """
    if not _checks[0]:
        return
    if not isinstance(arr, cupy().ndarray):
        raise ValueError(f"{name}: expected a cupy.ndarray on the device, got {type(arr).__name__}")
    want = [("*" if s is None else str(s)) for s in shape]
    if arr.dtype != np.dtype(dtype) or arr.ndim != len(shape) or any(
            s is not None and arr.shape[i] != s for i, s in enumerate(shape)):
        raise ValueError(f"{name}: expected [{', '.join(want)}] {np.dtype(dtype)}, got {list(arr.shape)} {arr.dtype}")
    if contiguous and not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")


def out_or_new(name: str, out: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
    """`out` checked against shape / dtype, or a new uninitialised device array."""
    if out is None:
        return cupy().empty(shape, dtype=dtype)
    require(name, out, dtype, shape)
    return out


def i32(v: int) -> np.int32:
    """A kernel's int argument."""
    return np.int32(v)


def f32(v: float) -> np.float32:
    """A kernel's float argument."""
    return np.float32(v)


KV_DTYPES = (np.dtype(np.float32), np.dtype(np.uint16))  # KV rows: fp32, or bfloat16 bits


def require_kv(name: str, arr: Any, shape: Sequence[int | None], like: Any = None) -> None:
    """`require` for KV rows: float32 or uint16 (bfloat16 bits), C-contiguous, of `shape`; with `like`, of its dtype
    too (a cache and its node rows, K and V, share one storage).

    Raises: ValueError naming `name` (unless inside `unchecked()`).
    """
    if not _checks[0]:
        return
    dtype = like.dtype if like is not None else getattr(arr, "dtype", None)
    if dtype not in KV_DTYPES:
        raise ValueError(f"{name}: KV rows must be float32 or uint16 (bfloat16 bits), got {dtype}")
    require(name, arr, dtype, shape)


def kv_suffix(arr: Any) -> str:
    """The kernel-name suffix of KV rows stored as `arr`'s dtype: "" for float32, "_bf16" for uint16 (bf16 bits).

    Raises: ValueError for another dtype.
    """
    if arr.dtype == np.float32:
        return ""
    if arr.dtype == np.uint16:
        return "_bf16"
    raise ValueError(f"KV rows must be float32 or uint16 (bfloat16 bits), got {arr.dtype}")
