"""The split-K policy of the tensor-core GEMV (tandem/backend/cuda/gemv.py ksplit_for), on the CPU: which shapes
split and how far, for an H200's 132 SMs. No GPU or CuPy needed."""

from __future__ import annotations

import pytest

from tandem.backend.cuda import gemv


@pytest.mark.parametrize(("shape", "fmt", "want"), [
    ((5120, 17408), "nvfp4", 2),   # 27B down: 320 tiles
    ((5120, 6144), "nvfp4", 2),    # 27B GDN out / attention o
    ((5120, 6144), "fp8", 2),
    ((34816, 5120), "nvfp4", 1),   # 27B gate|up: 2176 tiles, enough blocks
    ((248320, 5120), "bf16", 1),   # the head
    ((4096, 12288), "nvfp4", 4),   # 9B down: 256 tiles, 96 chunks
    ((4096, 4096), "nvfp4", 2),    # 9B GDN out: 32 chunks, 2 a warp at KS = 2
    ((64, 256), "nvfp4", 1),       # 2 chunks: nothing to split
])
def test_ksplit_policy(shape: tuple[int, int], fmt: str, want: int) -> None:
    assert gemv.ksplit_for(*shape, fmt, sms=132) == want


def test_ksplit_policy_off_and_bounded() -> None:
    saved = gemv.KSPLIT_BLOCKS_PER_SM
    try:
        gemv.KSPLIT_BLOCKS_PER_SM = 0
        assert gemv.ksplit_for(16, 1 << 20, "bf16", sms=132) == 1
        gemv.KSPLIT_BLOCKS_PER_SM = 1000
        assert gemv.ksplit_for(16, 1 << 20, "bf16", sms=132) == gemv.KSPLITS[-1]
    finally:
        gemv.KSPLIT_BLOCKS_PER_SM = saved
