"""CUDA sampling (cuda/sample.cu) vs tandem.sampling.choose_token on fresh random rows and settings.

Checks: ids equal to the reference's on ≥ 99.9% of rows (the figure is recorded), the winner's Gumbel noise bitwise
equal to gumbel_noise_at, NaN / -inf rows as the CPU treats them (-1 where it raises), greedy = numpy.argmax,
outputs NaN/-1 poisoned before the call, ValueError on bad arguments.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from tandem.backend.cuda import sample as sm  # noqa: E402
from tandem.backend.cuda.checks import record  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU")]

# (temperature, top_k, top_p, min_p): plain, Qwen's recommended settings, each filter alone and all together
SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (0.6, 20, 0.95, 0.0), (1.0, 0, 0.9, 0.0), (0.8, -1, 1.0, 0.1),
            (1.3, 50, 0.8, 0.05), (0.3, 1, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (0.0, 0, 1.0, 0.0)]


def _run(logits: np.ndarray, setting: tuple[float, int, float, float], seed: int,
         positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    t, k, p, m = setting
    ids = cp.full(logits.shape[0], -7, dtype=cp.int32)
    noise = cp.full(logits.shape[0], np.nan, dtype=cp.float32)
    sm.sample_rows(cp.asarray(logits), t, k, p, m, seed, positions, out=ids, noise_out=noise)
    return cp.asnumpy(ids), cp.asnumpy(noise)


@pytest.mark.parametrize(("vocab", "rows"), [(12288, 200), (248320, 6)])
def test_sample_rows_match_choose_token(vocab: int, rows: int) -> None:
    seed = secrets.randbits(64)
    rng = np.random.default_rng(seed)
    same = total = 0
    for setting in SETTINGS:
        logits = (rng.standard_normal((rows, vocab)) * rng.uniform(1.0, 6.0, (rows, 1))).astype(np.float32)
        logits[0, :7] = logits[0, 7]  # ties
        positions = [int(x) for x in rng.integers(0, 1 << 20, rows)]
        ids, noise = _run(logits, setting, seed, positions)
        ref = sm.reference(logits, *setting, seed, positions)
        same += int(np.sum(ids == ref))
        total += rows
        assert (ids >= 0).all(), f"{setting}: no candidate on a row with finite logits"
        if setting[0] != 0.0:
            want = sm.reference_noise(seed, positions, ids)
            assert np.array_equal(noise.view(np.uint32), want.view(np.uint32)), f"{setting} seed={seed}: noise bits"
        else:
            assert np.array_equal(ids, ref), "greedy must equal numpy.argmax exactly"
    frac = same / total
    record(f"sample_rows[V={vocab}]", match=frac, rows=total, seed=seed)
    assert frac >= 0.999, f"V={vocab} seed={seed}: ids equal on {same}/{total} rows ({frac:.5f})"


@pytest.mark.parametrize("setting", SETTINGS)
def test_sample_rows_nan_and_infinities(setting: tuple[float, int, float, float]) -> None:
    seed = secrets.randbits(64)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((6, 5000)).astype(np.float32)
    logits[0, rng.choice(5000, 40, replace=False)] = np.nan  # some NaN: never chosen when sampling
    logits[1, :] = -np.inf  # every token masked: -1 (choose_token raises)
    logits[1, 3] = np.nan
    logits[2, :] = np.nan
    logits[3, rng.choice(5000, 4000, replace=False)] = -np.inf
    logits[4, 100:4990] = np.nan  # fewer finite values than top_k in some settings
    logits[5, 17] = -0.0
    logits[5, 18] = 0.0
    positions = list(range(6))
    ids, _ = _run(logits, setting, seed, positions)
    ref = sm.reference(logits, *setting, seed, positions)
    assert np.array_equal(ids, ref), f"{setting} seed={seed}: {ids} vs {ref}"


def test_sample_rows_rejects_bad_arguments() -> None:
    z = cp.zeros((2, 10), cp.float32)
    with pytest.raises(ValueError, match="top_p"):
        sm.sample_rows(z, 1.0, 0, 0.0, 0.0, 1, [0, 1])
    with pytest.raises(ValueError, match="positions"):
        sm.sample_rows(z, 1.0, 0, 1.0, 0.0, 1, [0])
    with pytest.raises(ValueError, match="logits"):
        sm.sample_rows(cp.zeros(10, cp.float32), 1.0, 0, 1.0, 0.0, 1, [0])


def test_consecutive_positions_go_by_value() -> None:
    """Host positions p0, p0 + 1, ... go to the kernel as p0 (no upload): the same ids and noise as uploaded."""
    rng = np.random.default_rng(secrets.randbits(64))
    logits = cp.asarray(rng.standard_normal((5, 3000)).astype(np.float32) * 3)
    for setting in SETTINGS[:6]:
        t, k, p, m = setting
        by_value = sm.sample_rows(logits, t, k, p, m, 99, [1000, 1001, 1002, 1003, 1004],
                                  noise_out=cp.empty(5, cp.float32))
        noise = cp.empty(5, cp.float32)
        uploaded = sm.sample_rows(logits, t, k, p, m, 99, cp.arange(1000, 1005, dtype=cp.int64), noise_out=noise)
        assert np.array_equal(cp.asnumpy(by_value), cp.asnumpy(uploaded)), setting
        ref = sm.reference(cp.asnumpy(logits), *setting, 99, [1000, 1001, 1002, 1003, 1004])
        assert np.mean(cp.asnumpy(by_value) == ref) >= 0.8, setting


@pytest.mark.parametrize("vocab", [5, 50, 8191, 8193, 70000])
def test_sample_rows_small_and_peaked_rows_deterministic(vocab: int) -> None:
    """Vocabularies smaller than a team's threads (8 × 1024 on sm_90+: idle ranks) and around it, peaked rows like a
    model's (a few large logits over a flat tail); every setting; a second call gives the same ids and noise bits."""
    seed = secrets.randbits(64)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((8, vocab)).astype(np.float32)
    logits[:, rng.integers(0, vocab, 3)] += np.float32(15.0)  # peaks
    logits[1] *= np.float32(0.01)  # nearly flat
    positions = list(range(100, 108))
    same = 0
    for setting in SETTINGS:
        ids, noise = _run(logits, setting, seed, positions)
        again, noise2 = _run(logits, setting, seed, positions)
        assert np.array_equal(ids, again) and np.array_equal(noise.view(np.uint32), noise2.view(np.uint32))
        same += int(np.sum(ids == sm.reference(logits, *setting, seed, positions)))
    assert same >= len(SETTINGS) * 8 - 1, f"seed={seed}: {same} of {len(SETTINGS) * 8} rows as choose_token"


@pytest.mark.parametrize("pens", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 1.5), (0.8, -0.4, 0.9)])
def test_apply_penalties_is_penalty_state_apply(pens: tuple[float, float, float]) -> None:
    """apply_penalties == PenaltyState.apply bit for bit (±inf, ±0 and negative logits included; a NaN stays NaN, a
    subnormal result comes out as zero: the device flushes them), in place; prev counts the last id first (the
    device loop's update), a -1 prev counts nothing."""
    rng = np.random.default_rng(secrets.randbits(64))
    vocab = 5000
    logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
    logits[:10] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 1.17e-38, -3e-39, -0.0, 0.0]
    counts = np.zeros(vocab, dtype=np.int32)
    counts[rng.integers(0, vocab, 300)] = rng.integers(1, 5, 300)
    counts[:8] = 1
    counts[8:10] = 0  # unseen zeros: x - p · 0 keeps the sign rules of float32
    prompt = (rng.random(vocab) < 0.1).astype(np.uint8)
    for prev in (None, 17, 3, -1):
        want_counts = counts.copy()
        want = sm.reference_penalties(logits, want_counts, prompt, *pens, prev=prev)
        got, dev_counts = cp.asarray(logits), cp.asarray(counts)
        sm.apply_penalties(got, dev_counts, cp.asarray(prompt), *pens,
                           prev=None if prev is None else cp.asarray([prev], dtype=cp.int32))
        got_h = cp.asnumpy(got)
        nan = np.isnan(want)  # a NaN stays NaN (the device's is the canonical NaN, NumPy keeps the payload)
        tiny = (want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)  # subnormal: the device flushes to zero
        same = ~nan & ~tiny
        assert np.array_equal(np.isnan(got_h), nan) and np.all(got_h[tiny] == 0), (pens, prev)
        assert np.array_equal(got_h[same].view(np.uint32), want[same].view(np.uint32)), (pens, prev)
        assert np.array_equal(cp.asnumpy(dev_counts), want_counts), (pens, prev)
    with pytest.raises(ValueError, match="counts"):
        sm.apply_penalties(cp.asarray(logits), cp.zeros(vocab, cp.int64), cp.asarray(prompt), *pens)
