"""Sampling: parameter validation, penalties, masks, position-keyed Gumbel noise, and the sampler's distribution."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tandem.sampling import (PenaltyState, SamplingParams, choose_token, gumbel_noise, gumbel_noise_at,
                             logprobs_of, process_logits)

LOGITS8 = np.array([1.2, 0.3, -0.5, 2.0, 0.0, -1.5, 1.9, 0.8], dtype=np.float32)


def chi2_sf(stat: float, df: int) -> float:
    """P[X > stat] for X ~ chi-square(df): scipy when installed, else the regularized upper gamma Q(df/2, stat/2)."""
    try:
        from scipy.stats import chi2  # type: ignore[import-untyped, unused-ignore]
        return float(chi2.sf(stat, df))
    except ImportError:
        return _upper_gamma_q(df / 2.0, stat / 2.0)


def _upper_gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series for x < a + 1, continued fraction otherwise)."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1
            term *= x / n
            total += term
        return 1.0 - total * math.exp(log_front)
    tiny = 1e-300  # modified Lentz
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def test_chi2_fallback_matches_known_values() -> None:
    assert _upper_gamma_q(1.0, 2.0) == pytest.approx(math.exp(-2.0), rel=1e-12)  # df=2: sf = exp(-x/2)
    assert _upper_gamma_q(2.5, 5.5) == pytest.approx(0.0513800, abs=1e-6)  # chi2.sf(11.0, 5)
    assert _upper_gamma_q(2.5, 0.5) == pytest.approx(0.9625658, abs=1e-6)  # chi2.sf(1.0, 5)


def expected_probs(logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """softmax(logits / T) with top-k, top-p, min-p applied, written independently in float64."""
    x = logits.astype(np.float64) / t
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    keep = order[:top_k] if top_k > 0 else order
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    cum, n = 0.0, 0
    for n, pi in enumerate(p, start=1):
        cum += pi
        if cum >= top_p:
            break
    keep = keep[:n]
    keep = [i for i in keep if math.exp(x[i] - x[keep].max()) >= min_p]
    out = np.zeros(len(x))
    out[keep] = np.exp(x[keep] - x[keep].max())
    probs: np.ndarray = out / out.sum()
    return probs


@pytest.mark.parametrize("t,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.3),
    (0.9, 6, 0.9, 0.05)])
def test_sampler_distribution_chi_square(t: float, top_k: int, top_p: float, min_p: float) -> None:
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p).validate()
    num_draws = 20000
    counts = np.zeros(8, dtype=np.int64)
    for position in range(num_draws):
        counts[choose_token(LOGITS8, params, None, 1234, position)] += 1
    expected = expected_probs(LOGITS8, t, top_k, top_p, min_p)
    assert np.all(counts[expected == 0] == 0), "a masked token was drawn"
    live = expected > 0
    stat = float(((counts[live] - num_draws * expected[live]) ** 2 / (num_draws * expected[live])).sum())
    assert chi2_sf(stat, int(live.sum()) - 1) > 0.01, (counts, expected * num_draws)
    # the sampler's masks are the same as the independent ones
    processed = process_logits(LOGITS8, params, None)
    assert np.array_equal(np.isfinite(processed), live)


def test_greedy_is_argmax_first_index_on_ties() -> None:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0)
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert choose_token(x, params, None, 7, 3) == int(np.argmax(x))
    tied = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert choose_token(tied, params, None, 1, 0) == 1


def test_same_seed_and_position_same_token_in_any_order() -> None:
    rng = np.random.default_rng(1)
    logits = [rng.standard_normal(5000).astype(np.float32) for _ in range(64)]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    in_order = [choose_token(logits[p], params, None, 99, p) for p in range(64)]
    positions = list(range(64))
    random.Random(3).shuffle(positions)
    shuffled = {p: choose_token(logits[p], params, None, 99, p) for p in positions}
    assert in_order == [shuffled[p] for p in range(64)]
    assert in_order != [choose_token(logits[p], params, None, 100, p) for p in range(64)]


def _noise_reference(seed: int, position: int, token: int) -> np.float32:
    """The documented formula with Python ints (what a CUDA kernel must reproduce)."""
    m = (1 << 64) - 1

    def fmix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    stream = fmix((seed & m) ^ fmix((position + 0x9E3779B97F4A7C15) & m))
    bits = fmix((stream + (token + 1) * 0x9E3779B97F4A7C15) & m)
    u = ((bits >> 40) + 0.5) / 2.0 ** 24
    return np.float32(-math.log(-math.log(u)))


def test_gumbel_noise_formula_and_statistics() -> None:
    for seed, position in [(0, 0), (1, 7), (-5, 123456), (2 ** 64 - 1, 2 ** 40)]:
        noise = gumbel_noise(seed, position, 300)
        assert noise.dtype == np.float32 and noise.shape == (300,)
        for token in (0, 1, 17, 299):
            assert noise[token] == _noise_reference(seed, position, token)
        ids = np.array([299, 3, 17])
        assert np.array_equal(gumbel_noise_at(seed, position, ids), noise[ids])
    big = gumbel_noise(42, 0, 200000).astype(np.float64)
    assert abs(big.mean() - 0.5772156649) < 0.01 and abs(big.std() - math.pi / math.sqrt(6)) < 0.01
    assert np.all(np.isfinite(big))
    with pytest.raises(ValueError, match="position"):
        gumbel_noise(0, -1, 4)


def test_penalties_hand_computed() -> None:
    logits = np.array([2.0, -1.0, 0.5, 0.0, 3.0], dtype=np.float32)
    state = PenaltyState(5, [0, 1], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    for token in (2, 2, 4):
        state.add(token)
    # repetition over {0,1,2,4}: [1, -2, 0.25, 0, 1.5]; frequency counts [0,0,2,0,1]; presence [0,0,1,0,1]
    assert state.apply(logits).tolist() == [1.0, -2.0, -1.0, 0.0, 0.75]
    branch = state.copy()
    branch.add(3)
    assert state.output_counts[3] == 0 and branch.output_counts[3] == 1
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    from_params = PenaltyState.from_params(params, 5, [0, 1])
    assert from_params.apply(logits).tolist() == [1.0, -2.0, 0.5, 0.0, 3.0]  # prompt tokens: repetition only
    assert choose_token(logits, SamplingParams(temperature=0.0), state, 0, 0) == 0  # penalised argmax
    with pytest.raises(ValueError, match="out of range"):
        state.add(5)
    with pytest.raises(ValueError, match="shape"):
        state.apply(np.zeros(4, dtype=np.float32))


def test_masks_break_ties_by_token_index() -> None:
    x = np.array([1.0, 1.0, 1.0, 0.0], dtype=np.float32)
    assert np.isfinite(process_logits(x, SamplingParams(top_k=2), None)).tolist() == [True, True, False, False]
    probs = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    assert np.isfinite(process_logits(probs, SamplingParams(top_p=0.75), None)).tolist() == [True, True, False]
    assert np.isfinite(process_logits(probs, SamplingParams(top_p=0.01), None)).tolist() == [True, False, False]
    assert np.isfinite(process_logits(probs, SamplingParams(min_p=0.5), None)).tolist() == [True, True, False]
    scaled = process_logits(np.array([1.0, 2.0], dtype=np.float32), SamplingParams(temperature=0.5), None)
    assert scaled.tolist() == [2.0, 4.0]


def test_logprobs_of() -> None:
    x = np.array([1.0, 3.0, 3.0, -2.0], dtype=np.float32)
    ref = x.astype(np.float64) - math.log(np.exp(x.astype(np.float64)).sum())
    chosen, top = logprobs_of(x, 0, 3)
    assert chosen == pytest.approx(ref[0], abs=1e-12)
    assert [i for i, _ in top] == [1, 2, 0]
    assert [lp for _, lp in top] == pytest.approx([ref[1], ref[2], ref[0]], abs=1e-12)
    assert logprobs_of(x, 3, 0)[1] == []
    with pytest.raises(ValueError):
        logprobs_of(x, 4, 1)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("max_tokens", 0), ("stop_token_ids", [-1]), ("stop", [""]), ("logprobs", 21), ("seed", 1.5)])
def test_validation_names_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_defaults_valid_and_seed_resolution() -> None:
    params = SamplingParams().validate()
    assert params.top_k == 0 and params.stop == [] and params.stop_token_ids is None and not params.greedy
    assert SamplingParams(seed=5).resolved_seed() == 5
    seeds = {params.resolved_seed() for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2 ** 64 for s in seeds)
