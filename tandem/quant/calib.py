"""Activation statistics for the clip search: each Linear's input mean squares over a calibration text.

The unquantised model runs on the text (prefill, all positions' logits so the head sees every row too) with every
Linear wrapped in a recording proxy; nothing in the model changes. The proxies are found by walking the adapter's
weight dataclasses, so this knows no architecture: a Linear is recorded under its checkpoint name prefix.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tandem.formats.linear import Linear

F32Array = npt.NDArray[np.float32]
CHUNK_TOKENS = 512


class _Recorder:
    """A Linear that sums x² per input channel, then delegates (shape and bytes are the wrapped Linear's)."""

    def __init__(self, inner: Linear, name: str) -> None:
        self.inner = inner
        self.name = name
        self.shape = inner.shape
        self.bytes_per_use = inner.bytes_per_use
        self.sum_sq = np.zeros(inner.shape[1], np.float64)
        self.num_rows = 0

    def _record(self, x: F32Array) -> None:
        xd = x.astype(np.float64)
        self.sum_sq += np.einsum("ti,ti->i", xd, xd)
        self.num_rows += x.shape[0]

    def matmul(self, x: F32Array) -> F32Array:
        self._record(x)
        return self.inner.matmul(x)


def _wrap(obj: Any, found: dict[int, _Recorder]) -> None:
    """Replace every Linear held in the fields of dataclass `obj` (recursing into dataclasses and lists)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Linear) and not isinstance(item, _Recorder):
                    value[i] = found.setdefault(id(item), _Recorder(item, str(getattr(item, "name", ""))))
                elif dataclasses.is_dataclass(item):
                    _wrap(item, found)
        elif isinstance(value, Linear) and not isinstance(value, _Recorder):
            setattr(obj, f.name, found.setdefault(id(value), _Recorder(value, str(getattr(value, "name", "")))))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            _wrap(value, found)


def activation_mean_squares(model: Any, token_ids: list[int]) -> dict[str, F32Array]:
    """Run `model` (an adapter with `weights`, `head`, `new_state`, `prefill`) over `token_ids` and return each
    Linear's per-input-channel mean of x², keyed by checkpoint name prefix (e.g. `...layers.0.mlp.up_proj`).

    The model's Linears are wrapped for the run and restored afterwards.

    Args:
        model: a loaded adapter instance. token_ids: the calibration tokens (≥ 1).
    Returns:
        name -> [in] float32 mean squares (Linears that never ran are absent).
    Raises:
        ValueError: no tokens.
    """
    if not token_ids:
        raise ValueError("the calibration text has no tokens")
    found: dict[int, _Recorder] = {}
    weights = model.weights
    saved = _snapshot(weights)
    head = model.head
    try:
        _wrap(weights, found)
        model.head = found.setdefault(id(head), _Recorder(head, str(getattr(head, "name", "lm_head"))))
        state = model.new_state(len(token_ids))
        for start in range(0, len(token_ids), CHUNK_TOKENS):
            model.prefill(state, token_ids[start:start + CHUNK_TOKENS], all_logits=True)
    finally:
        _restore(weights, saved)
        model.head = head
    return {r.name: (r.sum_sq / r.num_rows).astype(np.float32) for r in found.values() if r.num_rows}


def _snapshot(obj: Any) -> list[tuple[Any, str | int, Any]]:
    """Every (container, field or index, value) slot holding a Linear, to undo `_wrap`."""
    slots: list[tuple[Any, str | int, Any]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        items = list(enumerate(value)) if isinstance(value, list) else [(f.name, value)]
        container = value if isinstance(value, list) else obj
        for key, item in items:
            if isinstance(item, Linear):
                slots.append((container, key, item))
            elif dataclasses.is_dataclass(item) and not isinstance(item, type):
                slots += _snapshot(item)
    return slots


def _restore(obj: Any, slots: list[tuple[Any, str | int, Any]]) -> None:
    for container, key, value in slots:
        if isinstance(key, int):
            container[key] = value
        else:
            setattr(container, key, value)


def calibration_tokens(model_dir: str | Path, text: str, max_tokens: int) -> tuple[Any, list[int]]:
    """Load the checkpoint at `model_dir` with its tokenizer and encode `text` (first `max_tokens` tokens).

    Returns: (the adapter instance, token ids). Raises ValueError when the checkpoint has no tokenizer.
    """
    from tandem.engine import Engine

    engine = Engine.from_pretrained(model_dir, device="cpu")
    if engine.tokenizer is None:
        raise ValueError(f"{model_dir}: calibration needs the checkpoint's tokenizer.json")
    return engine.model, engine.tokenizer.encode(text)[:max_tokens]
