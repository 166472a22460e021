"""Test helpers for images in: a random vision tower of a checkpoint's vision config (tools/make_checkpoint.py
writes only a few ``model.visual.*`` tensors, enough for the language loader to skip by name, not a whole tower)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tandem.models.qwen3_5.vision import VisionHParams, VisionTower


def random_tower_tensors(hp: VisionHParams, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the tower (``VisionTower.tensor_shapes``), float32: LayerNorm weights 1 + N(0, 0.2), every
    other tensor N(0, 0.2) (hf_reference.write_hf_vl_checkpoint's draws), drawn in name order from ``seed``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(VisionTower.tensor_shapes(hp).items()):
        r = rng.standard_normal(shape).astype(np.float32) * np.float32(0.2)
        out[name] = r + np.float32(1) if "norm" in name and name.endswith("weight") else r
    return out


def random_towers(monkeypatch: pytest.MonkeyPatch, seed: int = 0) -> None:
    """Make ``VisionTower.load`` build the random tower of the checkpoint's vision config (``random_tower_tensors``)
    instead of reading ``model.visual.*``."""
    def load(cls: Any, ckpt: Any, hp: VisionHParams) -> VisionTower:
        return VisionTower.from_tensors(hp, random_tower_tensors(hp, seed))

    monkeypatch.setattr(VisionTower, "load", classmethod(load))
