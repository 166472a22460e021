"""A sequence's chosen ids, picked on the device (argmax.py's argmax or sample.py's sampler) and copied to the host
asynchronously, so the next step can be queued before the host reads the id (the engine's run-ahead loop).

No kernel of its own: it queues argmax / sample_rows / apply_penalties launches and an asynchronous copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.argmax import argmax
from tandem.backend.cuda.loader import cupy
from tandem.backend.cuda.sample import apply_penalties, sample_rows


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
    before it is sent (a prompt token replaced by the discarded id: the next request's tokens would change). Freed,
    the allocation goes back to the driver (cudaFreeHost), never to another transfer.
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
