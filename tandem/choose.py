"""Choosing a token from logits: one chooser for plain and speculative rounds, on the host or the device.

Every token the engine emits is chosen here, from logits with a plain decode's bits at the token's absolute
position, so speculative output equals plain output (greedy or seeded sampling).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.generation import Constraint, TokenLogprob
from tandem.sampling import PenaltyState, SamplingParams, choose_token, logprobs_of


def constraint_choose(logits: Any, constraint: Constraint | None, params: SamplingParams,
                       penalties: PenaltyState | None, seed: int, position: int) -> int:
    """Choose a token under the constraint's mask (the same code for plain and speculative rounds) and advance
    the constraint with it.

    ``logits`` [V] float32 is a NumPy array (CPU backend) or a device array (CUDA backend). On the device, a
    choice with no constraint and no penalties is made there (``device_choose``: only the id crosses); any other
    choice copies the row to the host and runs the CPU code.
    Raises: ValueError when no token is left to choose (every logit -inf or NaN, or masked).
    """
    if not isinstance(logits, np.ndarray):
        if constraint is None and penalties is None:
            return device_choose(logits, params, seed, position)
        logits = host_logits(logits)
    mask = constraint.allowed() if constraint is not None else None
    masked = logits if mask is None else np.where(mask, logits, np.float32(-np.inf)).astype(np.float32)
    token = choose_token(masked, params, penalties, seed, position)
    if constraint is not None:
        constraint.advance(token)
    return token


def host_logits(logits: Any) -> np.ndarray:
    """Logits as a host NumPy float32 array (a device array is copied; a NumPy array is returned as is)."""
    if isinstance(logits, np.ndarray):
        return logits
    return np.asarray(logits.get(), dtype=np.float32)


def device_choose(logits: Any, params: SamplingParams, seed: int, position: int) -> int:
    """``choose_token`` of device logits [V] without penalties, on the device: the argmax (first maximum, exact)
    for greedy params, else tandem/backend/cuda/sample.py's sampler (the same Gumbel-max draw keyed by (seed,
    position, id); the id equals the CPU's except where a top-p / min-p cut or two candidates lie within float
    rounding). Only the id is copied back. Raises: ValueError when no token is left (choose_token's error)."""
    return checked_id(device_choose_rows(logits.reshape(1, -1), params, seed, [position])[0])


def device_choose_rows(logits: Any, params: SamplingParams, seed: int, positions: list[int]) -> list[int]:
    """``device_choose`` of every row of device logits [N, V] at its position, in one launch and one copy (a
    verified tree's nodes: each row's id is the one ``device_choose`` gives it alone, the sampler being
    row-invariant). -1 marks a row with no token left (``checked_id`` raises when the walk takes it)."""
    from tandem.backend.cuda.sample import sample_rows

    ids = sample_rows(logits, params.temperature, params.top_k, params.top_p, params.min_p, seed, positions)
    return [int(t) for t in ids.get()]


def checked_id(token: int) -> int:
    """A device-chosen id; -1 (the sampler found no candidate) raises choose_token's ValueError."""
    if token < 0:
        raise ValueError("every token is masked (logits all -inf or NaN)")
    return token



def logprob(logits: Any, token: int, k: int | None) -> TokenLogprob:
    lp, top = logprobs_of(host_logits(logits), token, k or 0)
    return TokenLogprob(token, lp, top)

