"""CUDA embedding lookup (cuda/embed.cu) vs the reference (exact BF16 widening): one token by value, several
through a device id array, NaN-poisoned outputs fully written, ValueError on bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import embed as em  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]


@pytest.mark.parametrize("ids", [[5], [0, 999, 5, 5], list(range(64))])
def test_embed_matches_reference(ids: list[int]) -> None:
    rng = np.random.default_rng()
    bits = rng.integers(0, 1 << 16, size=(1000, 384), dtype=np.uint16)
    out = cp.full((len(ids), 384), np.nan, dtype=cp.float32)
    em.embed(cp.asarray(bits), ids, out=out)
    got, ref = cp.asnumpy(out), em.reference(bits, ids)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_embed_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bits"):
        em.embed(cp.zeros((4, 8), cp.float32), [0])
    with pytest.raises(ValueError, match="ids"):
        em.embed(cp.zeros((4, 8), cp.uint16), [])


def test_embed_from_device_ids() -> None:
    rng = np.random.default_rng()
    bits = rng.integers(0, 1 << 16, size=(50, 64), dtype=np.uint16)
    ids = [3, 49, 0]
    out = cp.full((3, 64), np.nan, dtype=cp.float32)
    em.embed(cp.asarray(bits), ids, out=out, ids_device=cp.asarray(ids, dtype=cp.int32))
    assert np.array_equal(cp.asnumpy(out).view(np.uint32), em.reference(bits, ids).view(np.uint32))


@pytest.mark.parametrize("split", [None, "f16", "f16p", "bf16"])
def test_embed_norm_is_embed_then_rms_norm(split: str | None) -> None:
    """embed_norm: the row (== reference) and its RMSNorm as the first GEMV's operand, bitwise equal to embed then
    rms_norm(split=...); NaN-poisoned outputs fully written."""
    from tandem.backend.cuda.rms_norm import rms_norm
    from tandem.dtypes import f32_to_bf16

    rng = np.random.default_rng()
    bits = f32_to_bf16(rng.standard_normal((300, 5120)).astype(np.float32))
    w = cp.asarray((1.0 + 0.1 * rng.standard_normal(5120)).astype(np.float32))
    x = cp.full((1, 5120), np.nan, dtype=cp.float32)
    got = cp.asnumpy(em.embed_norm(cp.asarray(bits), 17, w, 1e-6, x, split=split))
    assert np.array_equal(cp.asnumpy(x).view(np.uint32), em.reference(bits, [17]).view(np.uint32))
    want = cp.asnumpy(rms_norm(x, w, 1e-6, split=split))
    view = np.uint32 if split is None else np.uint16
    assert np.array_equal(got.view(view), want.view(view))


@pytest.mark.parametrize("split", [None, "f16"])
def test_embed_norm_reads_a_device_token(split: str | None) -> None:
    """embed_norm with the id in a device int32 [1] (the previous step's argmax) == the same id by value."""
    from tandem.dtypes import f32_to_bf16

    rng = np.random.default_rng()
    bits = cp.asarray(f32_to_bf16(rng.standard_normal((300, 512)).astype(np.float32)))
    w = cp.asarray((1.0 + 0.1 * rng.standard_normal(512)).astype(np.float32))
    x1, x2 = (cp.full((1, 512), np.nan, dtype=cp.float32) for _ in range(2))
    want = cp.asnumpy(em.embed_norm(bits, 211, w, 1e-6, x1, split=split))
    got = cp.asnumpy(em.embed_norm(bits, cp.asarray([211], dtype=cp.int32), w, 1e-6, x2, split=split))
    assert np.array_equal(cp.asnumpy(x1).view(np.uint32), cp.asnumpy(x2).view(np.uint32))
    view = np.uint32 if split is None else np.uint16
    assert np.array_equal(got.view(view), want.view(view))
    with pytest.raises(ValueError, match="token"):
        em.embed_norm(bits, cp.asarray([1, 2], dtype=cp.int32), w, 1e-6, x2, split=split)


@pytest.mark.parametrize("split", [None, "f16", "bf16"])
def test_embed_norm_step_equals_embed_norm(split: str | None) -> None:
    """EmbedNormStep (a launch plan's embedding call: prebuilt argument block, plan.Relaunch) == embed_norm bit for
    bit, for host ids and device ids alternating in one step object (the row, the normed operand rewritten in
    place); a device id of the wrong shape raises."""
    from tandem.dtypes import f32_to_bf16

    rng = np.random.default_rng()
    bits = cp.asarray(f32_to_bf16(rng.standard_normal((300, 512)).astype(np.float32)))
    w = cp.asarray((1.0 + 0.1 * rng.standard_normal(512)).astype(np.float32))
    x1, x2 = (cp.full((1, 512), np.nan, dtype=cp.float32) for _ in range(2))
    step = em.EmbedNormStep(bits, w, 1e-6, x1, split=split)
    view = np.uint32 if split is None else np.uint16
    for token in [5, cp.asarray([211], dtype=cp.int32), 299, 0, cp.asarray([17], dtype=cp.int32), 17]:
        step(token)
        want = cp.asnumpy(em.embed_norm(bits, token, w, 1e-6, x2, split=split))
        assert np.array_equal(cp.asnumpy(x1).view(np.uint32), cp.asnumpy(x2).view(np.uint32)), token
        assert np.array_equal(cp.asnumpy(step.result).view(view), want.view(view)), token
    with pytest.raises(ValueError, match="token"):
        step(cp.asarray([1, 2], dtype=cp.int32))
