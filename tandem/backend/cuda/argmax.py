"""Greedy token choice on the GPU: argmax over the vocabulary, so only ids cross to the host.

Kernel: cuda/argmax.cu. Reference: numpy.argmax along the last axis (first maximum; a NaN wins); exact.
``top_k``: a drafter's k best ids of each row with the softmax normaliser (cuda/argmax.cu top_k_*), so a draft step
reads 2 + 2k words, not the row; reference ``reference_top_k``.
``TokenReader`` / ``PendingToken``: an id chosen on the device (argmax or sample.py's sampler) and copied to the host
asynchronously, so the next step can be queued first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel

KERNELS = ("argmax_partial", "argmax_final", "top_k_partial", "top_k_final")
TOP_K_MAX = 4  # cuda/argmax.cu TOPK_MAX
THREADS = 256
MAX_PARTS = 128


def argmax(logits: Any, out: Any = None) -> Any:
    """ids[t] = argmax_j logits[t, j].

    Args: logits [T, V] float32 (device, contiguous), V ≥ 1.
    Returns: [T] int32 on the device. Raises: ValueError on a bad dtype / shape.
    """
    require("logits", logits, np.float32, (None, None))
    rows, vocab = (int(s) for s in logits.shape)
    if vocab < 1 or rows < 1:
        raise ValueError(f"logits: need T ≥ 1 and V ≥ 1, got {list(logits.shape)}")
    ids = out_or_new("out", out, (rows,), np.int32)
    parts = max(1, min(MAX_PARTS, -(-vocab // (THREADS * 8))))
    cp = cupy()
    part_val = cp.empty((rows, parts), dtype=cp.float32)
    part_idx = cp.empty((rows, parts), dtype=cp.int32)
    kernel("argmax", "argmax_partial")((parts, rows), (THREADS,), (logits, part_val, part_idx, i32(vocab)))
    kernel("argmax", "argmax_final")((rows,), (THREADS,), (part_val, part_idx, ids, i32(parts)))
    return ids


def top_k(logits: Any, k: int, out: Any = None) -> Any:
    """The k best ids of each row and the row's softmax normaliser, on the device.

    Args: logits [T, V] float32 (device, contiguous), V ≥ 1; 1 ≤ k ≤ TOP_K_MAX; out: optional [T, 2 + 2k] int32.
    Returns: out [T, 2 + 2k] int32 (device): per row the max of its non-NaN values (its value exact; the sign of a
    zero max may follow the reduction order) and the sum of exp(x - max) over the row (float32 bits; a NaN in the row
    makes the sum NaN, one +inf makes it 1, more +infs NaN), the k ids (larger logit first, ties to the smaller id, a
    NaN first; past V, 0x7FFFFFFF with -inf), then their logits (float32 bits). ``unpack_top_k`` reads a host copy.
    Launches: 2.
    Raises: ValueError on a bad dtype / shape or k.
    """
    require("logits", logits, np.float32, (None, None))
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [T, V], got {list(logits.shape)}")
    rows, vocab = (int(s) for s in logits.shape)
    if vocab < 1 or rows < 1:
        raise ValueError(f"logits: need T ≥ 1 and V ≥ 1, got {list(logits.shape)}")
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= TOP_K_MAX:
        raise ValueError(f"k must be in 1..{TOP_K_MAX}, got {k}")
    res = out_or_new("out", out, (rows, 2 + 2 * k), np.int32)
    parts = max(1, min(MAX_PARTS, -(-vocab // (THREADS * 8))))
    cp = cupy()
    part_val = cp.empty((rows, parts, k), dtype=cp.float32)
    part_idx = cp.empty((rows, parts, k), dtype=cp.int32)
    part_lse = cp.empty((rows, parts, 2), dtype=cp.float32)
    kernel("argmax", "top_k_partial")((parts, rows), (THREADS,), (logits, part_val, part_idx, part_lse, i32(vocab),
                                                                   i32(k)))
    kernel("argmax", "top_k_final")((rows,), (THREADS,), (part_val, part_idx, part_lse, res, i32(parts), i32(k)))
    return res


def unpack_top_k(packed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A host copy of ``top_k``'s result [T, 2 + 2k] int32 -> (ids [T, k] int32, probabilities [T, k] float64 =
    exp(logit - max) / sum: the whole row's softmax at those ids (0 for a missing id past V, NaN in a row with a
    NaN), logits [T, k] float32)."""
    packed = np.ascontiguousarray(packed, dtype=np.int32)
    floats = packed.view(np.float32)
    mx, total = floats[:, :1].astype(np.float64), floats[:, 1:2].astype(np.float64)
    ids, vals = packed[:, 2:2 + k].copy(), floats[:, 2 + k:2 + 2 * k].copy()
    with np.errstate(invalid="ignore", over="ignore"):
        probs = np.exp(vals.astype(np.float64) - mx) / total
    probs[ids == 0x7FFFFFFF] = 0.0
    return ids, probs, vals


def reference_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """NumPy twin of ``top_k`` (the same packing; the sum in float64, so it equals the kernel's to rounding)."""
    rows, vocab = logits.shape
    out = np.zeros((rows, 2 + 2 * k), dtype=np.int32)
    fl = out.view(np.float32)
    for t in range(rows):
        x = np.asarray(logits[t], dtype=np.float32)
        nan = np.isnan(x)
        order = np.lexsort((np.arange(vocab), -np.where(nan, 0, x), ~nan))[:k]  # NaN first, larger, smaller id
        real = x[~nan & ~np.isneginf(x)]
        mx = float(real.max()) if real.size else -np.inf
        if nan.any():
            total = np.nan
        elif np.isposinf(mx):  # the kernel's running sum: one +inf counts 1, a second one makes it NaN
            total = 1.0 if int(np.isposinf(real).sum()) == 1 else np.nan
        else:
            total = np.exp(real.astype(np.float64) - mx).sum() if real.size else 0.0
        fl[t, 0], fl[t, 1] = np.float32(mx), np.float32(total)
        out[t, 2:2 + k] = 0x7FFFFFFF
        fl[t, 2 + k:2 + 2 * k] = -np.inf
        out[t, 2:2 + len(order)] = order
        fl[t, 2 + k:2 + k + len(order)] = x[order]
    return out


def reference(logits: np.ndarray) -> np.ndarray:
    """numpy.argmax over the last axis, int32."""
    ids: np.ndarray = np.argmax(logits, axis=-1).astype(np.int32)
    return ids


class TokenReader:
    """A sequence's chosen ids, picked on the device and read by the host without stalling the GPU.

    ``choose(logits, ...)`` launches the argmax (or, for a sampling temperature, cuda/sample.cu's sampler) into
    ``device`` (int32 [1]), then an asynchronous copy of it into one of two pinned host slots and an event; it
    returns a ``PendingToken`` at once. The next decode step can read ``device`` on the GPU (cuda/embed.cu
    embed_bf16_one_norm's token pointer) and be queued before the host has the id, so the GPU never waits for the
    host between steps (the engine's plain loop runs one step ahead). Stream order keeps it exact: the copy of
    step n's id is queued before step n + 1's kernels, which overwrite ``device`` only in their own choice.
    At most two ids may be outstanding (the slots alternate): ``PendingToken.get`` raises RuntimeError for an id
    whose slot was reused. Allocated once per sequence (8 bytes of pinned memory, 8 bytes of device memory; with
    penalties 5 bytes a vocabulary id more, at the first call).
    The pinned slots are a page-locked allocation of their own (cupy.cuda.PinnedMemory), not a block of CuPy's
    pinned memory pool: a reader can be dropped with a copy still queued (the run-ahead loop's step after an eos is
    discarded with its id), and a pool block would be handed at once to the next host-to-device transfer that stages
    through the pool (cupy.asarray of a NumPy array: the next prompt's ids), which the late copy would then overwrite
    before it is sent (seen on the H200: a prompt token replaced by the discarded id, the next request's sampled
    tokens changed). Freed, the allocation goes back to the driver (cudaFreeHost), never to another transfer.
    Raises: ImportError without CuPy.
    """

    def __init__(self) -> None:
        cp = cupy()
        self.device: Any = cp.zeros((1,), dtype=cp.int32)
        self._noise = cp.zeros((1,), dtype=cp.float32)  # the sampler's winner noise (unused here)
        self._pinned = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(8), 0)  # not the pool's: see above
        self._host = np.frombuffer(self._pinned, dtype=np.int32, count=2)
        self._events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
        self.issued = 0  # ids chosen so far; id k lives in slot k % 2
        self._penalties: tuple[Any, Any] | None = None  # device output counts [V] int32, prompt mask [V] uint8

    def choose(self, logits: Any, params: Any = None, seed: int = 0, position: int = 0,
               penalties: Any = None) -> "PendingToken":
        """Queue the choice of an id from device logits [V] float32 and its copy to the host.

        params: a ``SamplingParams`` (None or temperature 0: the argmax, first maximum); otherwise
        ``sample.sample_rows`` with its temperature, top-k, top-p and min-p at (seed, position): the id
        ``choose_token`` would pick, up to float rounding at a cut (sample.py), or -1 when no token is left.
        penalties: an active ``PenaltyState`` (else None): its counts and prompt mask are uploaded at the first
        call, then kept on the device: every later call counts the id chosen before it (sample.apply_penalties'
        prev), so the host's state is not updated. The logits are penalised in place (bit for bit
        PenaltyState.apply).
        Returns: the pending id (``get()`` waits for it). Raises: ValueError on bad logits or settings.
        """
        cp = cupy()
        if penalties is not None:
            from tandem.backend.cuda.sample import apply_penalties

            prev = self.device
            if self._penalties is None:
                self._penalties = (cp.asarray(penalties.output_counts, dtype=cp.int32),
                                   cp.asarray(penalties.prompt_mask.astype(np.uint8)))
                prev = None
            counts, prompt = self._penalties
            apply_penalties(logits.reshape(-1), counts, prompt, penalties.repetition_penalty,
                            penalties.frequency_penalty, penalties.presence_penalty, prev=prev)
        row = logits.reshape(1, -1)
        if params is None or params.greedy:
            argmax(row, out=self.device)
        else:
            from tandem.backend.cuda.sample import sample_rows

            sample_rows(row, params.temperature, params.top_k, params.top_p, params.min_p, seed, [position],
                        out=self.device, noise_out=self._noise)
        slot = self.issued % 2
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(self._pinned.ptr + 4 * slot, self.device.data.ptr, 4,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._events[slot].record(stream)
        self.issued += 1
        return PendingToken(self, self.issued - 1)

    def read(self, index: int) -> int:
        """The host value of id ``index`` (waits for its copy). Raises: RuntimeError if its slot was reused."""
        if self.issued - index > 2:
            raise RuntimeError(f"token {index} was overwritten: {self.issued} ids chosen, two slots")
        slot = index % 2
        self._events[slot].synchronize()
        return int(self._host[slot])


class PendingToken:
    """An id chosen on the device (``TokenReader.choose``); ``get()`` is its value on the host (-1: the sampler
    found no token left).

    ``latest``: True while no later id was chosen on the same reader, i.e. the reader's device slot still holds
    this id (a decode step may then read it there: CudaQwen3_5Model.decode).
    """

    def __init__(self, reader: TokenReader, index: int) -> None:
        self.reader, self.index = reader, index
        self._value: int | None = None

    @property
    def latest(self) -> bool:
        return self.reader.issued == self.index + 1

    def get(self) -> int:
        """The id (waits for the device to reach it the first time). Raises: RuntimeError if overwritten."""
        if self._value is None:
            self._value = self.reader.read(self.index)
        return self._value
