"""CUDA argmax over the vocabulary (cuda/argmax.cu) vs numpy.argmax: exact, ties to the first index, NaN wins."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import argmax as am  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]


@pytest.mark.parametrize("shape", [(1, 1), (1, 1000), (1, 248320), (4, 248320), (3, 151936)])
def test_argmax(shape: tuple[int, int]) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(shape).astype(np.float32)
    if shape[1] > 10:  # a tie on the maximum at two places: the first wins
        i, j = sorted(rng.choice(shape[1], size=2, replace=False))
        logits[0, i] = logits[0, j] = np.float32(100.0)
    ids = cp.full(shape[0], -1, dtype=cp.int32)
    am.argmax(cp.asarray(logits), out=ids)
    assert np.array_equal(cp.asnumpy(ids), am.reference(logits)), f"seed={seed}"
    record(f"argmax{list(shape)}", exact=True, seed=seed)


def test_argmax_nan_and_infinities() -> None:
    logits = np.full((2, 5000), -np.inf, dtype=np.float32)
    logits[1, 4000] = np.nan
    logits[1, 4100] = np.nan
    logits[1, 10] = np.inf
    assert np.array_equal(cp.asnumpy(am.argmax(cp.asarray(logits))), am.reference(logits))


def test_argmax_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="logits"):
        am.argmax(cp.zeros(10, cp.float32))
