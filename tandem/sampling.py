"""Sampling: request parameters, penalties, logit masks and position-keyed Gumbel-max token choice.

A token is chosen as `argmax(processed_logits + gumbel_noise(seed, position))`. The noise depends only on
(seed, absolute position, token id), so the choice at a position is the same whatever the decode schedule
(plain decode, a verified draft tree, a restored cache): speculation compares the model's choice with the guess
and stays an exact sample (Gumbel-max trick: argmax(x + G), G i.i.d. standard Gumbel, is distributed as
softmax(x)). References: vLLM `SamplingParams` / `apply_penalties` semantics; HF `RepetitionPenaltyLogitsProcessor`.
"""

from __future__ import annotations

import copy
import math
import os
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["SamplingParams", "PenaltyState", "process_logits", "choose_token", "logprobs_of",
           "gumbel_noise", "gumbel_noise_at", "MAX_LOGPROBS", "MAX_STOPS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS",
           "MIN_TEMPERATURE", "NonFiniteLogitsError"]

F32 = npt.NDArray[np.float32]
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_STOPS = 16  # stop strings a request may give (OpenAI: 4; vLLM: no bound)
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 1024  # entries of stop_token_ids
MIN_TEMPERATURE = 1e-5  # the smallest positive temperature: below it x / T overflows float32 or divides by zero


class NonFiniteLogitsError(ValueError):
    """The model's logits hold NaN or +inf: its weights are broken or its arithmetic overflowed."""

    def __init__(self) -> None:
        super().__init__("the model's logits are not finite (NaN or inf): its weights are broken (check the "
                         "checkpoint with `tandem gate`) or its arithmetic overflowed")


# ---- Position-keyed Gumbel noise -------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9  # splitmix64 finalizer multipliers (Stafford's Mix13)
_MIX2 = 0x94D049BB133111EB


def _fmix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finalizer on uint64 (wrapping arithmetic): z^=z>>30; z*=MIX1; z^=z>>27; z*=MIX2; z^=z>>31."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def gumbel_noise_at(seed: int, position: int, token_ids: npt.NDArray[np.integer[Any]]) -> F32:
    """Standard Gumbel noise for the given token ids at (seed, position): [N] float32.

    Exact formula (all integer ops on uint64, wrapping mod 2^64; fmix64 as in `_fmix64`):
        s      = seed mod 2^64                      (Python ints, so negative seeds wrap)
        stream = fmix64(s XOR fmix64(position + GOLDEN))
        bits   = fmix64(stream + (token + 1) · GOLDEN)
        u      = ((bits >> 40) + 0.5) · 2^-24        float64, exact; u ∈ (0, 1), never 0 or 1
        g      = float32(−log(−log(u)))              log in float64, then one rounding to float32
    GOLDEN = 0x9E3779B97F4A7C15, MIX1 = 0xBF58476D1CE4E5B9, MIX2 = 0x94D049BB133111EB.
    A CUDA kernel reproduces u bit for bit with 64-bit integer ops; g matches whenever both float64 logs are
    within an ulp of exact (they can differ only when the float64 value sits on a float32 rounding boundary).
    Depends on nothing but (seed, position, token): the same for any decode schedule.
    Raises ValueError for position < 0 or a negative token id.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and ids.min() < 0:
        raise ValueError("token ids must be >= 0")
    with np.errstate(over="ignore"):
        key = _fmix64(np.array([(position + _GOLDEN) & _MASK64], dtype=np.uint64))
        stream = _fmix64(np.array([seed & _MASK64], dtype=np.uint64) ^ key)
        counter = (ids.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
        bits = _fmix64(stream + counter)
    u = ((bits >> np.uint64(40)).astype(np.float64) + 0.5) * (2.0 ** -24)
    return (-np.log(-np.log(u))).astype(np.float32)


def gumbel_noise(seed: int, position: int, vocab_size: int) -> F32:
    """Gumbel noise for every token id at (seed, position): [V] float32 (formula in `gumbel_noise_at`)."""
    return gumbel_noise_at(seed, position, np.arange(vocab_size, dtype=np.int64))


@dataclass
class SamplingParams:
    """Per-request sampling settings (OpenAI/vLLM names and meanings).

    temperature 0 is greedy, a positive one must be at least MIN_TEMPERATURE (the server maps smaller ones to 0);
    top_k 0 or -1 is off; stop_token_ids None means the checkpoint's
    generation_config eos ids; seed None means a random seed (see `resolved_seed`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """True when temperature == 0: the token is the argmax of the penalised logits."""
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        """Check every field; return self. Raises ValueError naming the first bad field and its value."""
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = [  # (field, ok, rule)
            ("temperature", math.isfinite(self.temperature)
             and (self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE),
             f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= -1, "an int >= -1 (0 or -1 = off)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
             "> 0 and finite"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("seed", self.seed is None or is_int(self.seed), "an int (used mod 2^64) or None"),
            ("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("stop_token_ids", self.stop_token_ids is None or (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(is_int(t) and t >= 0 for t in self.stop_token_ids)),
             f"None or a list of at most {MAX_STOP_TOKEN_IDS} non-negative ints"),
            ("stop", len(self.stop) <= MAX_STOPS
             and all(isinstance(t, str) and 0 < len(t) <= MAX_STOP_CHARS for t in self.stop),
             f"a list of at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters"),
            ("logprobs", self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"None or an int in [0, {MAX_LOGPROBS}]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                shown = reprlib.repr(getattr(self, name))  # bounded: a huge or deep value is not echoed whole
                raise ValueError(f"{name} must be {rule}, got {shown}")
        return self

    def resolved_seed(self) -> int:
        """The request's seed, or (seed None) a fresh random 64-bit one from os.urandom on every call: the engine
        calls it once per request and keeps the result."""
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")


class PenaltyState:
    """Token statistics of one sequence for repetition / frequency / presence penalties (vLLM semantics).

    Args:
        vocab_size: V, the width of the logits.
        prompt_ids: the prompt's token ids (they count for the repetition penalty only).
        repetition_penalty, presence_penalty, frequency_penalty: as in SamplingParams.
    Layout: `output_counts` [V] int32 (times each id was generated), `prompt_mask` [V] bool.
    Raises ValueError for a prompt id outside [0, V).
    """

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int] | npt.NDArray[np.integer[Any]] = (),
                 *, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0) -> None:
        self.vocab_size = int(vocab_size)
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.output_counts = np.zeros(self.vocab_size, dtype=np.int32)  # [V] int32
        self.prompt_mask = np.zeros(self.vocab_size, dtype=np.bool_)  # [V] bool
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"prompt token id out of range [0, {self.vocab_size})")
        self.prompt_mask[ids] = True

    @classmethod
    def from_params(cls, params: SamplingParams, vocab_size: int,
                    prompt_ids: Sequence[int] | npt.NDArray[np.integer[Any]] = ()) -> PenaltyState:
        """A PenaltyState with the request's three penalty values."""
        return cls(vocab_size, prompt_ids, repetition_penalty=params.repetition_penalty,
                   presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)

    @property
    def active(self) -> bool:
        """False when every penalty is neutral (apply is then a copy)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def add(self, token_id: int) -> None:
        """Count one generated token. Raises ValueError for an id outside [0, V)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        self.output_counts[token_id] += 1

    def copy(self) -> PenaltyState:
        """An independent copy (a draft-tree branch continues from it)."""
        other = copy.copy(self)
        other.output_counts = self.output_counts.copy()
        other.prompt_mask = self.prompt_mask.copy()
        return other

    def apply(self, logits: F32) -> F32:
        """Penalised logits, a new [V] float32 array; all arithmetic in float32.

        In order (vLLM `apply_penalties`):
        1. repetition r over prompt ∪ output tokens: x := x / r where x > 0, else x := x · r;
        2. frequency f over output tokens: x := x − f · count;
        3. presence p over output tokens: x := x − p · [count > 0].
        Raises ValueError when logits are not of shape [V].
        """
        x = np.array(logits, dtype=np.float32, copy=True)
        if x.shape != (self.vocab_size,):
            raise ValueError(f"logits must have shape [{self.vocab_size}], got {list(x.shape)}")
        if not self.active:
            return x
        seen = self.output_counts > 0  # [V] bool
        if self.repetition_penalty != 1.0:
            r = np.float32(self.repetition_penalty)
            mask = seen | self.prompt_mask
            x[mask] = np.where(x[mask] > 0, x[mask] / r, x[mask] * r)
        if self.frequency_penalty != 0.0:
            x -= np.float32(self.frequency_penalty) * self.output_counts.astype(np.float32)
        if self.presence_penalty != 0.0:
            x -= np.float32(self.presence_penalty) * seen.astype(np.float32)
        return x


def _top_ids(x: npt.NDArray[np.floating[Any]], k: int) -> npt.NDArray[np.intp]:
    """The k ids of largest x, descending, lower id first on ties (== argsort(-x, stable)[:k], faster)."""
    k = min(k, x.shape[0])
    if k <= 0:
        return np.empty(0, dtype=np.intp)
    kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]  # the k-th largest value
    shortlist = np.flatnonzero(x >= kth)  # ascending ids; more than k only on ties at kth
    return shortlist[np.argsort(-x[shortlist], kind="stable")][:k]


def process_logits(logits: F32, params: SamplingParams, penalties: PenaltyState | None) -> F32:
    """Logits that `choose_token` samples from: [V] float32, masked tokens −inf.

    Steps (deterministic; ties broken by lower token id):
    1. penalties (`PenaltyState.apply`), if given;
    2. temperature: x / float32(T) (skipped for T == 0 and T == 1);
    3. top-k (k > 0): keep the k largest;
    4. top-p (p < 1): probabilities q = softmax(x) in float64 over kept tokens; keep the smallest prefix of the
       descending order whose float64 cumulative sum is ≥ p (always the top token);
    5. min-p (m > 0): keep tokens with q ≥ m · max q, evaluated as exp(x − max x) ≥ m in float64.
    Raises ValueError when logits are not 1-D.
    """
    x = penalties.apply(logits) if penalties is not None else np.array(logits, dtype=np.float32, copy=True)
    if x.ndim != 1:
        raise ValueError(f"logits must be 1-D [V], got shape {list(x.shape)}")
    if params.temperature not in (0.0, 1.0):
        x = x / np.float32(params.temperature)
    num_vocab = x.shape[0]
    k = params.top_k if 0 < params.top_k < num_vocab else num_vocab
    if k < num_vocab or params.top_p < 1.0:
        keep = _top_ids(x, k)
        if params.top_p < 1.0:
            kept = x[keep].astype(np.float64)
            q = np.exp(kept - kept[0])
            cumulative = np.cumsum(q / q.sum())
            num_keep = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
            keep = keep[:min(num_keep, keep.shape[0])]
        masked = np.full(num_vocab, -np.inf, dtype=np.float32)
        masked[keep] = x[keep]
        x = masked
    if params.min_p > 0.0:
        top = float(x.max())
        if math.isfinite(top):
            ratio = np.exp(x.astype(np.float64) - top)  # q_i / q_max, independent of normalisation
            x[ratio < params.min_p] = -np.inf
    return x


def choose_token(logits: F32, params: SamplingParams, penalties: PenaltyState | None,
                 seed: int, position: int, check_finite: bool = True) -> int:
    """The token at absolute `position`.

    Greedy (T == 0): argmax of the penalised logits, first (lowest) id on ties.
    Otherwise: argmax over unmasked ids of float32(process_logits(...) + gumbel_noise(seed, position, V)),
    lowest id on ties: an exact draw from softmax(process_logits(...)) by the Gumbel-max trick.
    Only the noise of unmasked ids is computed (same values as the full vector).
    ``check_finite`` False keeps the arithmetic's own answer for NaN / +inf logits instead of raising (greedy: the
    first NaN or +inf, as numpy.argmax; sampled: NaN and +inf are never candidates), the device sampler's contract
    (tandem/backend/cuda/sample.py's reference).
    Raises: NonFiniteLogitsError when the logits hold NaN or +inf (``check_finite``); ValueError when every id is
    masked.
    """
    if params.greedy:
        x = penalties.apply(logits) if penalties is not None else np.asarray(logits, dtype=np.float32)
        best = int(np.argmax(x))  # argmax picks the first NaN when there is one
        if check_finite and not x[best] < np.inf:
            raise NonFiniteLogitsError()
        return best
    if check_finite and not np.max(logits) < np.inf:  # NaN or +inf anywhere (masked ids are -inf)
        raise NonFiniteLogitsError()
    x = process_logits(logits, params, penalties)
    candidates = np.flatnonzero(np.isfinite(x))  # ascending ids, so argmax ties resolve to the lowest id
    if candidates.size == 0:
        raise ValueError("every token is masked (logits all -inf or NaN)")
    scores = x[candidates] + gumbel_noise_at(seed, position, candidates)  # float32
    return int(candidates[int(np.argmax(scores))])


def logprobs_of(logits: F32, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token_id` and the k most likely (id, logprob) pairs under softmax(logits).

    Which distribution: the caller passes the model's raw logits, as vLLM's default `raw_logprobs` does (no
    penalties, temperature or masks), so logprobs describe the model rather than the sampler. The log-softmax
    is computed in float64: logits − max − log Σ exp(logits − max). Top-k order: descending, lower id on ties.
    Raises ValueError for token_id outside [0, V) or k < 0.
    """
    x = np.asarray(logits, dtype=np.float64)
    if not (0 <= token_id < x.shape[0] and k >= 0):
        raise ValueError(f"need 0 <= token_id < {x.shape[0]} and k >= 0, got token_id={token_id}, k={k}")
    shifted = x - x.max()
    logp = shifted - math.log(float(np.exp(shifted).sum()))
    top = _top_ids(logp, k)
    return float(logp[token_id]), [(int(i), float(logp[i])) for i in top]
