"""Copies between a running state's buffers and a cached block's arrays, on the host or the device.

A block's arrays are NumPy (host state; the host and disk tiers) or CuPy (the device tier of a device state).
A copy into a state converts a host array to the device where the state lives there (one upload, queued on the
current stream straight from the host array when it is contiguous) and copies a device array on the device.
Spilling to the host tier copies into pinned host memory (``cupy.cuda.alloc_pinned_memory``): ``to_host`` waits
for the copy, ``download`` queues it on the current stream behind the work that writes the source and returns an
event to wait on, so a spill during a prefill does not stop the host from queuing the prefill's next launches.
A device array is copied on its own GPU's current stream (a tensor-parallel state's buffers live on several), and
a device-to-device copy between GPUs goes through unified addressing (``cudaMemcpyDefault``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

from tandem.dtypes import storage_dtype


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``), so memory freed by
    dropping many small cached arrays (each below malloc's mmap threshold, so kept in its arenas) leaves the
    process's resident set. Returns whether it could (False where the C library has no malloc_trim)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return False
    if trim is None:
        return False
    trim(0)
    return True


def on_device(arr: Any) -> bool:
    """Whether ``arr`` lives on the GPU (anything that is not a NumPy array)."""
    return not isinstance(arr, np.ndarray)


def _on(arr: Any) -> Any:
    """A context with ``arr``'s GPU current (nothing for a host array)."""
    return contextlib.nullcontext() if isinstance(arr, np.ndarray) else arr.device


def copy_of(arr: Any) -> Any:
    """A new array with ``arr``'s contents, on ``arr``'s side (device copies stay on its GPU)."""
    with _on(arr):
        return arr.copy()


def to_host(arr: Any, pinned: bool = True) -> np.ndarray:
    """``arr`` as a host array: itself when already NumPy, else a blocking download (into pinned memory)."""
    if isinstance(arr, np.ndarray):
        return arr
    if pinned:
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(max(1, int(arr.nbytes)))
        out: np.ndarray = np.frombuffer(mem, dtype=arr.dtype, count=int(arr.size)).reshape(arr.shape)
        arr.get(out=out)
        return out
    return np.asarray(arr.get())


def host_buffer(nbytes: int, pinned: bool) -> np.ndarray:
    """An uninitialised host buffer, uint8 [nbytes]: page-locked (CuPy's pinned pool) when ``pinned``."""
    if not pinned:
        return np.empty(max(1, int(nbytes)), dtype=np.uint8)
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(max(1, int(nbytes)))
    return np.frombuffer(mem, dtype=np.uint8, count=max(1, int(nbytes)))


def download(arr: Any) -> tuple[np.ndarray, Any]:
    """A pinned host copy of the device array ``arr``, queued on the current stream; returns (host array, event).

    The host array holds ``arr``'s contents once the event has completed (``event.synchronize()``) and must not
    be read before. ``arr`` may be let go at once: CuPy's memory pool hands its memory out again only to work on
    the same stream, which runs after the copy.
    """
    import cupy

    with _on(arr):
        src = cupy.ascontiguousarray(arr)
        out = pinned_like(src)
        stream = cupy.cuda.get_current_stream()
        if src.nbytes:
            cupy.cuda.runtime.memcpyAsync(out.ctypes.data, src.data.ptr, int(src.nbytes),
                                          cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
    return out, event


def pinned_like(arr: Any) -> np.ndarray:
    """An uninitialised pinned host array of ``arr``'s shape and dtype."""
    buf = host_buffer(int(arr.nbytes), True)
    out: np.ndarray = buf[:int(arr.nbytes)].view(arr.dtype).reshape(arr.shape)
    return out


def pinned_copy(src: np.ndarray) -> np.ndarray:
    """A copy of the host array ``src`` in pinned memory."""
    out = pinned_like(src)
    out[...] = src
    return out


def upload(src: np.ndarray) -> Any:
    """A new device array holding the host array ``src``, copied on the current stream (wait with
    ``synchronize`` before ``src``'s memory is reused)."""
    import cupy

    out = cupy.empty(src.shape, dtype=src.dtype)
    assign(out, src)
    return out


def assign(dst: Any, src: Any) -> None:
    """dst[...] = src across sides: a host source is uploaded to a device destination (queued on the current
    stream: wait with ``synchronize`` before ``src``'s memory is reused), a device source is downloaded to a host
    one."""
    if isinstance(dst, np.ndarray):
        dst[...] = src if isinstance(src, np.ndarray) else src.get()
        return
    import cupy

    with dst.device:
        if isinstance(src, np.ndarray):
            if dst.flags.c_contiguous and src.flags.c_contiguous and dst.shape == src.shape \
                    and dst.dtype == src.dtype:
                dst.set(src, stream=cupy.cuda.get_current_stream())  # one copy, no staging array
            else:
                dst[...] = cupy.asarray(src)
        elif src.device.id != dst.device.id and dst.flags.c_contiguous and src.flags.c_contiguous \
                and dst.shape == src.shape and dst.dtype == src.dtype:
            src.device.synchronize()  # the source's writes are done before this GPU's stream reads it
            dst.data.copy_from_device_async(src.data, int(src.nbytes), cupy.cuda.get_current_stream())
        else:
            dst[...] = src


def like(ref: Any, src: Any) -> Any:
    """A copy of ``src`` on ``ref``'s side (host or device)."""
    if isinstance(ref, np.ndarray):
        return np.array(src) if isinstance(src, np.ndarray) else np.asarray(src.get())
    import cupy

    return cupy.array(src)


def synchronize(arr: Any) -> None:
    """Wait for the device work that writes ``arr`` (nothing for a host array)."""
    if not isinstance(arr, np.ndarray):
        import cupy

        with arr.device:
            cupy.cuda.get_current_stream().synchronize()


def synchronize_all(arrs: Any) -> None:
    """Wait for the device work on every GPU that holds one of ``arrs`` (an iterable; host arrays are skipped):
    a tensor-parallel state's buffers live on several."""
    if "cupy" not in sys.modules:
        return  # no device array exists without CuPy
    import cupy

    for dev in sorted({int(a.device.id) for a in arrs if not isinstance(a, np.ndarray)}):
        with cupy.cuda.Device(dev):
            cupy.cuda.get_current_stream().synchronize()


def spec_rows_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one axis-0 row of a buffer of ``shape`` and ``dtype`` (a view's row, per token; a "bfloat16" row
    holds 2 bytes a value: dtypes.storage_dtype)."""
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n * int(storage_dtype(dtype).itemsize)


def spec_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a whole buffer of ``shape`` and ``dtype`` (a section)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * int(storage_dtype(dtype).itemsize)
