"""CUDA argmax over the vocabulary (cuda/argmax.cu) vs numpy.argmax: exact, ties to the first index, NaN wins."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import argmax as am  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.backend.cuda.token_reader import TokenReader  # noqa: E402

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


def _check_top_k(logits: np.ndarray, k: int, seed: int = 0) -> None:
    got = cp.asnumpy(am.top_k(cp.asarray(logits), k))
    want = am.reference_top_k(logits, k)
    assert got.shape == (logits.shape[0], 2 + 2 * k)
    np.testing.assert_array_equal(got[:, 2:], want[:, 2:], err_msg=f"ids / values, seed={seed}")  # exact
    np.testing.assert_array_equal(got.view(np.float32)[:, 0], want.view(np.float32)[:, 0],  # values (±0 equal)
                                  err_msg=f"max, seed={seed}")
    np.testing.assert_allclose(got.view(np.float32)[:, 1], want.view(np.float32)[:, 1], rtol=2e-5,
                               err_msg=f"sum, seed={seed}")


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1000), (1, 248320), (3, 151936), (2, 12288)])
def test_top_k(shape: tuple[int, int], k: int) -> None:
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    logits = (4 * rng.standard_normal(shape)).astype(np.float32)
    i, j, m = rng.choice(shape[1], size=3, replace=False)  # ties among the best: the smaller id first
    logits[0, [i, j, m]] = np.float32(50.0)
    _check_top_k(logits, k, seed)
    ids, probs, vals = am.unpack_top_k(cp.asnumpy(am.top_k(cp.asarray(logits), k)), k)
    x = logits.astype(np.float64)
    full = np.exp(x - x.max(axis=1, keepdims=True))
    full /= full.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(probs, np.take_along_axis(full, ids.astype(np.int64), axis=1), rtol=1e-5, atol=1e-12)
    record(f"top_k{list(shape)} k={k}", exact_ids=True, seed=seed)


def test_top_k_nan_infinities_and_short_rows() -> None:
    logits = np.full((3, 5000), -np.inf, dtype=np.float32)
    logits[0, 7] = 1.0  # one finite value: then -inf ones, smaller ids first
    logits[1, [4000, 4100]] = np.nan  # NaNs first, and a NaN sum
    logits[1, 10] = 3.0
    logits[2, 4999] = np.inf  # one +inf: the sum counts it 1
    _check_top_k(logits[:1], 3)
    _check_top_k(logits[2:], 3)
    two = logits[2:].copy()
    two[0, 20] = np.inf  # two: NaN
    _check_top_k(two, 2)
    assert np.isnan(cp.asnumpy(am.top_k(cp.asarray(two), 2)).view(np.float32)[0, 1])
    got = cp.asnumpy(am.top_k(cp.asarray(logits), 3))
    want = am.reference_top_k(logits, 3)
    np.testing.assert_array_equal(got[:, 2:5], want[:, 2:5])
    assert list(got[0, 2:5]) == [7, 0, 1] and list(got[1, 2:4]) == [4000, 4100]
    assert np.isnan(got.view(np.float32)[1, 1])
    _check_top_k(np.array([[2.0, 1.0]], dtype=np.float32), 4)  # V < k: the rest are (0x7FFFFFFF, -inf)
    assert list(cp.asnumpy(am.top_k(cp.asarray(np.array([[2.0, 1.0]], dtype=np.float32)), 4))[0, 2:6]) == \
        [0, 1, 0x7FFFFFFF, 0x7FFFFFFF]


def test_top_k_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must"):
        am.top_k(cp.zeros((1, 10), cp.float32), 5)
    with pytest.raises(ValueError, match="k must"):
        am.top_k(cp.zeros((1, 10), cp.float32), 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logits"):
        am.top_k(cp.zeros(10, cp.float32), 2)


def test_a_dropped_reader_never_hands_its_slots_to_the_next_upload() -> None:
    """A TokenReader dropped with its id copy still queued (the run-ahead loop discards the step after an eos) must
    not give its pinned slots to the next upload staged through CuPy's pinned pool (the next prompt's ids): the late
    copy would overwrite them before they are sent. The copy is held back behind a long kernel here."""
    logits = cp.zeros((1, 1000), dtype=cp.float32)
    logits[0, 123] = 1.0
    big = cp.ones((4096, 4096), dtype=cp.float32)
    for _ in range(20):
        want = np.arange(7, 9, dtype=np.int32) * 1000 + secrets.randbelow(1000)
        reader = TokenReader()
        for _ in range(3):
            big = big @ big * np.float32(1e-4)  # ~ms of queued work before the choice and its copy
        reader.choose(logits)
        del reader  # the copy of id 123 into its slots is still queued
        got = cp.asarray(want)  # staged through the pinned pool
        assert np.array_equal(cp.asnumpy(got), want)


def test_a_plan_records_only_its_own_threads_launches() -> None:
    """While one thread records a LaunchPlan, another thread's argmax launches run normally and stay out of the
    plan (the engine's slots sample outside their lock while another slot records): the plan holds its own
    thread's launch only, and its replay writes only its own output."""
    import threading

    from tandem.backend.cuda.plan import LaunchPlan

    rng = np.random.default_rng(5)
    mine = cp.asarray(rng.standard_normal((1, 5000)).astype(np.float32))
    theirs = cp.asarray(rng.standard_normal((1, 5000)).astype(np.float32))
    their_out = cp.full((1,), -7, dtype=cp.int32)
    inside, launched = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(30)
        am.argmax(theirs, out=their_out)
        launched.set()

    worker = threading.Thread(target=other)
    worker.start()
    plan = LaunchPlan()
    with plan.record():
        plan.outputs = am.argmax(mine)
        inside.set()
        assert launched.wait(30)
    worker.join()
    assert int(their_out.get()[0]) == int(np.argmax(cp.asnumpy(theirs)))
    before = len(plan)
    their_out[...] = -7
    plan.replay()
    assert int(their_out.get()[0]) == -7  # the other thread's launch is not replayed
    assert len(plan) == before and int(plan.outputs.get()[0]) == int(np.argmax(cp.asnumpy(mine)))
