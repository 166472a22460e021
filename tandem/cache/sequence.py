"""One request's use of the prefix cache: restore, chunked prefill with snapshots on the grid, the session snapshot.

``SequenceCache.prefill`` has the adapter's ``prefill`` signature, so the plain loop and the speculative loop
(through ``PrefillModel``) prefill the same way: restore the longest cached prefix, then prefill the rest in pieces
that end on the absolute grid of ``chunk`` tokens (a multiple of the model's own prefill chunk, so every position
is computed in the same piece as in a cold one-pass prefill), polling ``cancelled`` between pieces and publishing a
snapshot at every grid position it passes, and, for a model whose prefill is chunk-invariant
(``Capabilities.prefill_chunk_invariant``, or ``prefill_matches_decode``, which implies it), one at the prompt's end
when that is off the grid (a retried prompt, or a longer one that extends it, resumes there instead of at the grid
position before it). A model whose prefill is chunk-invariant only at multiples of ``Capabilities.prefill_grid``
(chunks on the absolute position grid) gets that snapshot at the prompt's last such multiple instead: the last piece
is cut there (which changes no bit), and the next turn restores it and prefills the rest (fewer than prefill_grid
tokens) again. The last piece's logits are the adapter's, so a restored request sees exactly what a cold one would.

``finish`` publishes the session snapshot (prompt + generated tokens) for a model whose prefill computes decode's
bits for every token (``Capabilities.prefill_matches_decode``: the NumPy Qwen3.5 adapter, the CUDA one off its
tensor-core prefill): the state as the request left it equals a cold prefill of its tokens, so it is copied as is. A
model without that guarantee publishes only its prompt's snapshots (a decoded state is not what a fresh engine's
prefill holds): the next turn of a conversation restores the previous prompt's last snapshot and prefills the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tandem.cache.store import PrefixCache

PREFILL_CHUNK = 64  # the adapters' prefill pieces end on multiples of this (numpy_ops.GDN_CHUNK, the CUDA prefill)


def resumable(caps: Any) -> bool:
    """Whether a model's prefill may continue from a state prefilled to a prompt's end (any length, or the last
    multiple of ``prefill_grid`` before it) with the bits of a one-pass prefill: ``prefill_chunk_invariant`` or
    ``prefill_matches_decode``."""
    return bool(caps.prefill_chunk_invariant or caps.prefill_matches_decode)


def resume_point(caps: Any, n: int) -> int:
    """Where a prompt of ``n`` tokens keeps its end snapshot: n, or for a model with ``prefill_grid`` > 1 (and no
    decode bits, which make any length resumable) the last multiple of that grid at or before n."""
    grid = int(getattr(caps, "prefill_grid", 0) or 0)
    if grid <= 1 or caps.prefill_matches_decode:
        return n
    return n // grid * grid


class PrefillCancelled(Exception):
    """The request was cancelled between two prefill pieces."""


class SequenceCache:
    """A request's prefill and snapshots.

    Args:
        model: the adapter. cache: the engine's cache (None: chunked prefill only). chunk: the grid in tokens.
        salt: the request's cache namespace. cancelled: polled before each piece (True raises PrefillCancelled).
    Attributes: cached_tokens: tokens restored by the last ``prefill``; cached_tier: the slowest cache tier they
        came from ("resident", "host", "disk"; "" when none were).
    """

    def __init__(self, model: Any, cache: PrefixCache | None, chunk: int, salt: str,
                 cancelled: Callable[[], bool] | None) -> None:
        self.model = model
        self.cache = cache
        self.chunk = chunk
        self.salt = salt
        self.cancelled = cancelled
        self.cached_tokens = 0
        self.cached_tier = ""
        self.prompt: list[int] = []
        self.with_hidden = False  # the request's drafter needs hidden rows (so must its snapshots)

    def prefill(self, state: Any, ids: Any, all_logits: bool = False,
                hidden_out: list[np.ndarray] | None = None) -> Any:
        """The adapter's ``prefill`` of a whole prompt into a fresh ``state``, through the cache.

        Returns: logits [V] float32 of the last token (the adapter's bits). With ``hidden_out``, hidden rows
        [T, E] of every prompt token are appended (restored ones first).
        Raises: PrefillCancelled; the adapter's ValueError on bad ids.
        """
        model, cache, c = self.model, self.cache, self.chunk
        if all_logits or state.length:
            return model.prefill(state, ids, all_logits=all_logits, hidden_out=hidden_out)
        ids = [int(t) for t in ids]
        if not self.prompt:
            self.prompt, self.with_hidden = ids, hidden_out is not None
        n, pos, logits = len(ids), 0, None
        if cache is not None and n <= state.max_len:
            hit = cache.restore(self.salt, ids, state, need_hidden=hidden_out is not None)
            pos, logits = hit.length, hit.logits
            self.cached_tier = hit.tier
            if hidden_out is not None and hit.hidden is not None and pos:
                hidden_out.append(hit.hidden)
        self.cached_tokens = pos
        resume = resume_point(model.capabilities, n) if cache is not None and resumable(model.capabilities) else -1
        while pos < n:
            if self.cancelled is not None and self.cancelled():
                raise PrefillCancelled
            stop = min(n, (pos // c + 1) * c)
            if pos < resume < stop:
                stop = resume  # the prompt's restore point (off the cache's grid, on the model's)
            piece: list[np.ndarray] | None = [] if hidden_out is not None else None
            if piece is not None:
                logits = model.prefill(state, ids[pos:stop], hidden_out=piece)
                hidden_out.extend(piece)  # type: ignore[union-attr]
            else:
                logits = model.prefill(state, ids[pos:stop])
            if cache is not None:
                cache.count_prefill(stop - pos)
                # a restore point on every grid position, and at the prompt's end (or the model's grid position
                # before it: resume_point) where that is off the grid (a retry, or a prompt that extends this one,
                # resumes there) for a chunk-invariant prefill
                if stop % c == 0 or stop == resume:
                    start = (stop - 1) // c * c  # the grid position the block starts on
                    rows = np.concatenate(piece) if piece and pos == start else None
                    if piece is None or rows is not None:
                        cache.snapshot(self.salt, ids, state, start, logits=logits, hidden=rows)
            pos = stop
        return logits

    def finish(self, state: Any, tokens: list[int]) -> None:
        """After a request that ended cleanly (or was cancelled between rounds): publish ``tokens[:state.length]``
        (the prompt and what the state has consumed of the output) as the session snapshot, for a model whose
        prefill matches its decode (module docstring)."""
        cache = self.cache
        if cache is None or not self.model.capabilities.prefill_matches_decode:
            return
        end = state.length
        if end <= len(self.prompt) and end % self.chunk == 0 or end > len(tokens):
            return  # the prompt's own snapshots already end there (or the state is not this sequence)
        c = self.chunk
        start = (min(len(self.prompt), end) // c) * c
        while start + c < end:
            if not cache.snapshot(self.salt, tokens, state, start, end=start + c, sections=False):
                return
            start += c
        cache.snapshot(self.salt, tokens, state, start)


class PrefillModel:
    """An adapter whose ``prefill`` goes through a ``SequenceCache``; every other attribute is the adapter's."""

    def __init__(self, model: Any, seq: SequenceCache) -> None:
        self._model = model
        self.prefill = seq.prefill

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
