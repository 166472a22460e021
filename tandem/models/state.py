"""Per-sequence model state: fixed-size sections and length-indexed views, allocated once.

Layout (DESIGN.md, "State: sections and views"):
- a **section** is a fixed-size buffer per sequence (a GDN layer's fp32 recurrent state [Hv, dk, dv], its conv
  tail [K-1, conv_dim]); it never grows.
- a **view** is a buffer indexed by token position (an attention layer's K or V rows [max_len, Hkv, D]); only
  the first ``length`` rows are meaningful.
Every buffer is allocated when the sequence starts; prefill, decode and commit write in place. Caches copy a
state by sections and by view length and know no model; ``signature`` refuses a restore across models.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.dtypes import storage_dtype


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a state: its name, shape, dtype name and kind ("section" or "view").

    dtype is a NumPy dtype name, or "bfloat16" (KV rows stored as bf16 bits in uint16: tandem/backend/kv_rows.py).

    For a view, axis 0 is the token position and its size is the state's ``max_len``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str


def spec_signature(specs: list[BufferSpec]) -> str:
    """SHA-256 over (name, kind, shape without the view length, dtype) of every buffer spec: a state's identity
    for caches, the same for a host ``ModelState`` and a device state of the same specs."""
    h = hashlib.sha256()
    for s in specs:
        shape = s.shape[1:] if s.kind == "view" else s.shape
        h.update(f"{s.name}|{s.kind}|{shape}|{s.dtype};".encode())
    return h.hexdigest()


def check_specs(specs: list[BufferSpec], max_len: int) -> None:
    """Raises ValueError for max_len < 1, a kind other than "section" / "view", or a view whose axis 0 is not
    max_len (the rules every state of these specs follows, on the host or the device)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    for spec in specs:
        if spec.kind not in ("section", "view"):
            raise ValueError(f"buffer {spec.name}: kind must be 'section' or 'view', got {spec.kind!r}")
        if spec.kind == "view" and spec.shape[0] != max_len:
            raise ValueError(f"view {spec.name}: axis 0 is {spec.shape[0]}, expected max_len {max_len}")


def allocate_buffers(specs: list[BufferSpec], zeros: Callable[..., Any]) -> dict[str, Any]:
    """name -> a zeroed array of each spec's shape and storage dtype (dtypes.storage_dtype: a "bfloat16" buffer
    holds uint16 bits), made by ``zeros(shape, dtype=...)`` (np.zeros for a host state, cupy.zeros for a device
    state)."""
    return {spec.name: zeros(spec.shape, dtype=storage_dtype(spec.dtype)) for spec in specs}


def state_nbytes(state: Any) -> int:
    """Bytes held by a host or device state's buffers (allocated capacity, not the used length)."""
    return sum(int(b.nbytes) for b in state.buffers.values())


def reset_state(state: Any) -> None:
    """Zero every buffer of a host or device state in place and set its length to 0 (a fresh sequence, no
    reallocation)."""
    for buf in state.buffers.values():
        buf.fill(0)
    state.length = 0


def copy_state(dst: Any, src: Any, convert: Callable[[Any], Any]) -> None:
    """Copy ``src``'s sections and the used rows of its views into ``dst`` in place (``convert`` moves an array
    to dst's side: identity on the host, an upload or a download across host and device), then its length.

    Raises: ValueError: the signatures differ (another model) or ``src`` is longer than ``dst``'s views.
    """
    if src.signature != dst.signature:
        raise ValueError("state signature mismatch: cannot copy a state across models")
    if src.length > dst.max_len:
        raise ValueError(f"state of {src.length} tokens does not fit max_len {dst.max_len}")
    for spec in dst.specs:
        buf = src.buffers[spec.name]
        if spec.kind == "section":
            dst.buffers[spec.name][...] = convert(buf)
        elif src.length:
            dst.buffers[spec.name][: src.length] = convert(buf[: src.length])
    dst.length = src.length


class ModelState:
    """The buffers of one sequence.

    Attributes:
        specs: the buffer specs, in a fixed order.
        buffers: name -> preallocated array (sections zeroed; views zeroed).
        length: number of committed tokens (positions 0..length-1 are valid in every view).
        max_len: capacity of the views in tokens.
    """

    def __init__(self, specs: list[BufferSpec], max_len: int) -> None:
        check_specs(specs, max_len)
        self.specs = list(specs)
        self.max_len = max_len
        self.length = 0
        self.buffers: dict[str, np.ndarray] = allocate_buffers(self.specs, np.zeros)
        self.multimodal: Any = None  # an image prompt's rows (models/qwen3_5/mrope.py), set per sequence

    @property
    def signature(self) -> str:
        """SHA-256 over (name, kind, shape without the view length, dtype) of every buffer."""
        return spec_signature(self.specs)

    def nbytes(self) -> int:
        """Bytes held by all buffers (allocated capacity, not the used length)."""
        return state_nbytes(self)

    def reset(self) -> None:
        """Zero every buffer in place and set length to 0 (a fresh sequence, no reallocation)."""
        reset_state(self)
        self.multimodal = None

    def copy_from(self, other: "ModelState") -> None:
        """Copy ``other``'s sections and the used rows of its views into this state, in place.

        Raises:
            ValueError: the signatures differ (another model) or ``other`` is longer than this state's views.
        """
        copy_state(self, other, np.asarray)
