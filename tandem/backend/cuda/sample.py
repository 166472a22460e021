"""Token choice on the GPU for rows without masks: the ids choose_token would pick, so only ids cross to the host.
Kernels: cuda/sample.cu (sample_rows; apply_penalties, PenaltyState.apply in place); greedy rows use cuda/argmax.cu.

Reference (`reference`): tandem.sampling.choose_token per row (process_logits + gumbel_noise_at, spec: the
Gumbel-max trick keyed by (seed, position, token id)); ids equal except where two candidates, or a top-p / min-p
cut, lie within float rounding; the winner's noise is gumbel_noise_at's value bit for bit (`reference_noise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda import argmax as argmax_op
from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.operand import NULL
from tandem.backend.cuda.loader import cupy, kernel
from tandem.sampling import PenaltyState, SamplingParams, choose_token, gumbel_noise_at

KERNELS = ("sample_rows", "apply_penalties")
THREADS = 1024
CLUSTER = 8  # blocks a row on sm_90+: one thread-block cluster (cuda/sample.cu S_CLUSTER); one block before
_MASK64 = (1 << 64) - 1


def sample_rows(logits: Any, temperature: float, top_k: int, top_p: float, min_p: float, seed: int,
                positions: Any, out: Any = None, noise_out: Any = None) -> Any:
    """ids[r] = choose_token(logits[r], params, None, seed, positions[r]) for params (temperature, top_k, top_p,
    min_p) and no penalties. One launch (sample_rows, or argmax's two for temperature 0).

    Args:
        logits: [R, V] float32 (device, contiguous), the raw model logits.
        temperature: ≥ 0 (0: greedy argmax, first id on ties, NaN wins as numpy.argmax). top_k: 0 or -1 off.
        top_p: in (0, 1]. min_p: in [0, 1]. seed: any int, used mod 2^64.
        positions: [R] absolute positions, a host int sequence (consecutive ones go by value: no upload) or a
            device int64 array.
        out: optional [R] int32. noise_out: optional [R] float32, written with the winner's Gumbel noise (NaN
        where no token is left; not written for greedy rows).
    Returns: [R] int32 on the device; -1 where every token is masked (choose_token raises there).
    Layout: a cluster of 8 blocks of 1024 threads per row on sm_90+ (one block before); the top-p cut costs up to
    ~36 passes over the row, most over the few keys near the cut held in shared memory.
    Raises: ValueError on a bad dtype / shape or a setting outside SamplingParams.validate's ranges.
    """
    require("logits", logits, np.float32, (None, None))
    rows, vocab = (int(s) for s in logits.shape)
    if rows < 1 or vocab < 1:
        raise ValueError(f"logits: need R ≥ 1 and V ≥ 1, got {list(logits.shape)}")
    SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed).validate()
    ids = out_or_new("out", out, (rows,), np.int32)
    if temperature == 0.0:
        return argmax_op.argmax(logits, out=ids)
    cp = cupy()
    pos0 = 0
    if isinstance(positions, cp.ndarray):
        require("positions", positions, np.int64, (rows,))
        pos = positions
    else:
        host = [int(p) for p in positions]
        if len(host) != rows or any(p < 0 for p in host):
            raise ValueError(f"positions: expected {rows} non-negative ints, got {host}")
        if host == list(range(host[0], host[0] + rows)):  # consecutive: by value, no upload
            pos, pos0 = NULL, host[0]
        else:
            pos = cp.asarray(host, dtype=cp.int64)
    noise = out_or_new("noise_out", noise_out, (rows,))
    k = top_k if 0 < top_k < vocab else vocab
    team = CLUSTER if int(cp.cuda.Device().compute_capability) >= 90 else 1
    kernel("sample", "sample_rows")((team, rows), (THREADS,), (
        logits, i32(vocab), i32(int(temperature != 1.0)), f32(temperature), i32(k), np.float64(top_p),
        np.float64(min_p), np.uint64(seed & _MASK64), pos, np.int64(pos0), ids, noise))
    return ids


def apply_penalties(logits: Any, counts: Any, prompt_mask: Any, repetition: float, frequency: float,
                    presence: float, prev: Any = None) -> Any:
    """PenaltyState.apply on the device, in place: logits [V] float32 (contiguous), counts [V] int32 (the output
    counts), prompt_mask [V] uint8 (the prompt's ids), the three penalties as in SamplingParams. prev: optional
    device int32 [1], the id chosen last: counted first (counts[prev] += 1 in the same launch; -1 counts nothing),
    so a device loop keeps counts without the host. Same float32 arithmetic and order as the reference: bit for bit,
    except that a subnormal result comes out as zero (the device flushes them; a NaN is the canonical NaN).
    Returns logits. Raises: ValueError on a bad dtype / shape.
    """
    require("logits", logits, np.float32, (None,))
    vocab = int(logits.shape[0])
    require("counts", counts, np.int32, (vocab,))
    require("prompt_mask", prompt_mask, np.uint8, (vocab,))
    if prev is not None:
        require("prev", prev, np.int32, (1,))
    kernel("sample", "apply_penalties")((-(-vocab // 256),), (256,), (
        logits, counts, prompt_mask, NULL if prev is None else prev, f32(repetition), f32(frequency), f32(presence),
        i32(vocab)))
    return logits


def reference_penalties(logits: np.ndarray, counts: np.ndarray, prompt_mask: np.ndarray, repetition: float,
                        frequency: float, presence: float, prev: int | None = None) -> np.ndarray:
    """PenaltyState.apply with these counts and prompt mask (after counting prev): [V] float32; counts updated."""
    state = PenaltyState(int(logits.shape[0]), np.flatnonzero(prompt_mask), repetition_penalty=repetition,
                         presence_penalty=presence, frequency_penalty=frequency)
    if prev is not None and 0 <= prev < counts.shape[0]:
        counts[prev] += 1
    state.output_counts = counts.astype(np.int32)
    return state.apply(logits)


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, seed: int,
              positions: Sequence[int]) -> np.ndarray:
    """choose_token row by row (no penalties, NaN / +inf kept as the kernel treats them: ``check_finite=False``):
    [R] int32, -1 where it raises (every token masked)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    out = np.empty(logits.shape[0], dtype=np.int32)
    for r in range(logits.shape[0]):
        try:
            out[r] = choose_token(logits[r], params, None, seed, int(positions[r]), check_finite=False)
        except (ValueError, IndexError):  # IndexError: process_logits' top-p on an all-NaN row
            out[r] = -1
    return out


def reference_noise(seed: int, positions: Sequence[int], ids: np.ndarray) -> np.ndarray:
    """gumbel_noise_at(seed, positions[r], [ids[r]]) per row: [R] float32 (NaN where ids[r] < 0)."""
    return np.array([gumbel_noise_at(seed, int(p), np.array([i]))[0] if i >= 0 else np.nan
                     for p, i in zip(positions, ids)], dtype=np.float32)
