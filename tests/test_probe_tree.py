"""tools/probe_tree.py's timing probes still apply to cuda/gemv.cu: each edit's anchor occurs exactly once, and the
probed text differs from the source (a probe that silently stopped applying would time the base twice)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("probe_tree", REPO / "tools" / "probe_tree.py")
assert _spec is not None and _spec.loader is not None
probe_tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe_tree)


@pytest.mark.parametrize("name", sorted(probe_tree.EDITS))
def test_probe_anchors_apply_once(name: str) -> None:
    text = (REPO / "cuda" / "gemv.cu").read_text()
    assert probe_tree.apply(text, [name]) != text  # apply raises unless every anchor occurs exactly once


def test_make_builds_a_probed_copy(tmp_path: Path) -> None:
    dest = tmp_path / "probe"
    probe_tree.make(dest, ["no_tail", "half_fold"])
    text = (dest / "cuda" / "gemv.cu").read_text()
    assert "probe no_tail" in text and text.count("probe half_fold") == 2
    assert (dest / "tandem" / "backend" / "cuda" / "gemv.py").exists() and (dest / "bench" / "decode.py").exists()
    with pytest.raises(KeyError):
        probe_tree.make(tmp_path / "other", ["no_such_probe"])
    assert not (tmp_path / "other").exists()  # checked before anything is copied
    with pytest.raises(ValueError):
        probe_tree.apply("no anchors here", ["no_tail"])
