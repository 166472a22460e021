"""Images in, on the CUDA model: what its verbs read from a sequence's ``state.multimodal`` (mrope.py
``MultimodalRows``, set by tandem/multimodal.py before the prefill).

- Prefill (the tensor-core path and the fallback): the image features replace the pad rows of the embedding
  (``place_features``), and each attention layer rotates the call's rows at their 3-D positions (``chunk_mrope``:
  vision_mrope.MRopeRows, uploaded once a call and read by every attention layer's prep).
- Decode and verify after the prompt: every position is index + delta, the same in t, h and w, so the rotation is
  the text one at a shifted position (``rope_shift``: the attention launchers' ``rope_shift``), rows and keys still
  by sequence index. Decode and verify take the same shift, so a verify row keeps a decode row's bits
  (speculative == plain).
A text-only sequence has no rows: every helper is then a no-op (None / 0) and the text path runs unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.loader import cupy
from tandem.models.qwen3_5.mrope import multimodal_rows


def rope_shift(state: Any, start: int, count: int = 1) -> int:
    """The rotary shift (position - index) of sequence indices start..start+count-1 of a decode or a verify: 0 for a
    text-only sequence; past an image prompt its delta.

    Raises: ValueError: the rows do not share one text position offset (an image pad row: those are prefilled,
    never decoded)."""
    rows = multimodal_rows(state)
    if rows is None:
        return 0
    if start >= rows.positions.shape[0]:
        return int(rows.delta)
    pos = rows.rope_positions(start, count)
    shift = pos - np.arange(start, start + count)[:, None]
    if not np.all(shift == shift[0, 0]):
        raise ValueError(f"positions {start}..{start + count - 1} hold image rows: prefill them, not decode")
    return int(shift[0, 0])


def chunk_mrope(state: Any, start: int, count: int, section: Any) -> Any:
    """vision_mrope.MRopeRows of a prefill call over indices start..start+count-1 (their [count, 3] positions on the
    device), or None for a text-only sequence."""
    rows = multimodal_rows(state)
    if rows is None:
        return None
    from tandem.backend.cuda.vision_mrope import MRopeRows

    return MRopeRows.upload(rows.rope_positions(start, count), section)


def place_features(x: Any, state: Any, start: int) -> None:
    """Overwrite, in x [T, E] float32 (device: the embedding rows of indices start..start+T-1), the image pad rows
    by their features (copied to the device if the rows hold host ones). No-op for a text-only sequence."""
    rows = multimodal_rows(state)
    if rows is None:
        return
    lo, hi = np.searchsorted(rows.rows, [start, start + int(x.shape[0])])
    if hi > lo:
        cp = cupy()
        index = cp.asarray(np.asarray(rows.rows[lo:hi] - start, dtype=np.int64))
        x[index] = cp.asarray(rows.features[lo:hi], dtype=np.float32)

