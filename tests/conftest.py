"""Shared pytest fixtures: tiny random Qwen3.5 checkpoints written by tools/make_checkpoint.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
for _p in (REPO_ROOT, REPO_ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# session fixtures of server_fixtures.py, registered here so that every module shares one
from server_fixtures import keyed_server, served_model  # noqa: E402,F401
from tools.make_checkpoint import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BF16 tiny checkpoint (write_checkpoint defaults: 4 layers, D=64, V=512, 2 shards, vision + MTP)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="session")
def tiny_ckpt_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FP8 block-scaled twin layout of `tiny_ckpt` (same seed; BF16 scales)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_fp8"), fp8=True)
