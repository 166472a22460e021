"""The text model's multimodal rows: 3-D rotary positions (temporal, height, width) and image features at the pads.

Source: transformers' ``Qwen3_5Model.get_rope_index`` / ``get_vision_position_ids`` and
``Qwen3_5TextRotaryEmbedding`` (models/qwen3_5/modeling_qwen3_5.py); facts in docs/vision.md.

- Text token at sequence index i: all three positions equal ``current``, which counts up by one a token.
- An image of grid (1, h, w) patches with merge m fills h/m · w/m pad tokens in row-major order; the token at merged
  (row r, col c) has positions (s, s + r, s + c), s the ``current`` before the image; after it ``current`` is
  s + max(h/m, w/m) (not s + the token count), so later text runs "behind" the sequence index.
- After the prompt, every position is ``index + delta``, delta = (last prompt position + 1) - prompt length (≤ 0).
- The rotary angles: frequency j (of rotary_dim / 2) rotates by the height position where j % 3 == 1 and
  j < 3·mrope_section[1], by the width position where j % 3 == 2 and j < 3·mrope_section[2], else by the temporal
  position (the interleaved layout; transformers applies it whatever ``mrope_interleaved`` says).

A text-only prompt has all three positions equal to the index and delta 0: the rows are then never attached, and
the engine's arithmetic is today's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.backend.numpy_ops import mrope_tables as mrope_tables

F32 = np.float32


@dataclass
class MultimodalRows:
    """One sequence's multimodal prompt, attached to its state (``state.multimodal``) before prefill.

    Attributes:
        positions: [n, 3] int64: (t, h, w) rotary positions of prompt tokens 0..n-1.
        delta: the offset of every position past the prompt: index + delta.
        rows: [K] int64 sequence indices of the image pad tokens, ascending.
        features: [K, E] float32: the vision tower's output row for each of ``rows`` (NumPy on the CPU engine, a
            CuPy array on the GPU engine's: cuda_images.place_features puts them on the device).
    """

    positions: np.ndarray
    delta: int
    rows: np.ndarray
    features: Any

    def rope_positions(self, start: int, count: int) -> np.ndarray:
        """[count, 3] int64 positions of sequence indices start..start+count-1."""
        idx = np.arange(start, start + count)
        out = np.repeat((idx + self.delta)[:, None], 3, axis=1)
        inside = idx < self.positions.shape[0]
        out[inside] = self.positions[idx[inside]]
        return out

    def place(self, x: np.ndarray, start: int) -> None:
        """Overwrite, in x [T, E] (embeddings of indices start..start+T-1), the rows of image pad tokens by their
        features."""
        lo, hi = np.searchsorted(self.rows, [start, start + x.shape[0]])
        if hi > lo:
            x[self.rows[lo:hi] - start] = self.features[lo:hi]


def read_mrope_section(text: dict[str, Any]) -> tuple[int, int, int]:
    """``rope_parameters.mrope_section`` of a text config, transformers' [11, 11, 10] when absent.
    Raises: ValueError (not three integers)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section") if isinstance(rope, dict) else None
    section = section or [11, 11, 10]
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(v, int) for v in section):
        raise ValueError("config field 'rope_parameters.mrope_section' must be a list of 3 integers")
    return section[0], section[1], section[2]


def multimodal_rows(state: Any) -> MultimodalRows | None:
    """The rows attached to a sequence's state (``state.multimodal``), or None for a text-only sequence."""
    rows = getattr(state, "multimodal", None)
    return rows if isinstance(rows, MultimodalRows) else None


def mrope_positions(ids: Sequence[int], grids: Sequence[tuple[int, int, int]], merge: int,
                    image_token_id: int) -> tuple[np.ndarray, int, np.ndarray]:
    """The 3-D positions of a prompt whose images' pads are expanded (each image a run of t·h·w/m² pad ids).

    Returns: (positions [n, 3] int64, delta, pad rows [K] int64).
    Raises: ValueError: the pad runs do not match the images (count or length).
    """
    n = len(ids)
    arr = np.asarray(ids, dtype=np.int64)
    pads = np.flatnonzero(arr == image_token_id)
    positions = np.empty((n, 3), np.int64)
    current, i, k = 0, 0, 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        size = t * gh * gw
        if k + size > len(pads):
            raise ValueError(f"the prompt has {len(pads)} image pad tokens; its images need more")
        first = int(pads[k])
        if first + size > n or not np.all(arr[first:first + size] == image_token_id):
            raise ValueError("an image's pad tokens are not one run of its feature count")
        positions[i:first] = (current + np.arange(first - i))[:, None]
        current += first - i
        tt, rr, cc = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[first:first + size, 0] = current + tt.reshape(-1)
        positions[first:first + size, 1] = current + rr.reshape(-1)
        positions[first:first + size, 2] = current + cc.reshape(-1)
        current += max(gh, gw)
        i, k = first + size, k + size
    if k != len(pads):
        raise ValueError(f"the prompt has {len(pads)} image pad tokens; its images fill {k}")
    positions[i:] = (current + np.arange(n - i))[:, None]
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta, pads


