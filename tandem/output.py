"""The tokens of one generation as they are chosen: stop ids, stop strings, the token budget, logprobs and the
pending chunk. Plain and speculative rounds push every token through one ``Output``, so they stop alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tandem.choose import logprob
from tandem.generation import GenerationChunk, RoundStats, TokenLogprob
from tandem.sampling import SamplingParams


class Output:
    """The tokens of one generation: stop ids, stop strings, the token budget, logprobs, the pending chunk."""

    def __init__(self, params: SamplingParams, stop_ids: set[int], stops: StopMatcher, detok: Any,
                 budget: int) -> None:
        self.params, self.stop_ids, self.stops, self.detok, self.budget = params, stop_ids, stops, detok, budget
        self.count = 0
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] = []

    def push(self, token: int, logits: Any) -> str | None:
        """Add a chosen token (``logits``: the raw logits it was chosen from, host or device); returns the finish reason if it ends
        generation ("stop": eos id or stop string; "length": the budget)."""
        self.count += 1
        self.token_ids.append(token)
        if self.params.logprobs is not None:
            self.logprobs.append(logprob(logits, token, self.params.logprobs))
        if token in self.stop_ids:  # the eos token's own text is not part of the output
            self.text += self.stops.finish(self.detok)
            return "stop"
        text, hit = self.stops.push(self.detok.push(token) if self.detok is not None else "")
        self.text += text
        if hit:
            return "stop"
        if self.count >= self.budget:
            self.text += self.stops.finish(self.detok)
            return "length"
        return None

    def push_polled(self, token: int, logits: Any, cancelled: Callable[[], bool] | None) -> str | None:
        """``push``, then, if the generation goes on, poll ``cancelled`` (True: ``abort``); the finish reason."""
        finish = self.push(token, logits)
        if finish is None and cancelled is not None and cancelled():
            finish = self.abort()
        return finish

    def abort(self) -> str:
        """End generation on cancellation: flush held text; returns "abort"."""
        self.text += self.stops.finish(self.detok)
        return "abort"

    def chunk(self, finish: str | None, stats: RoundStats | None) -> GenerationChunk:
        """The pending tokens and text as a chunk (and start a new one)."""
        c = GenerationChunk(self.token_ids, self.text, finish, self.logprobs, stats)
        self.token_ids, self.text, self.logprobs = [], "", []
        return c


class StopMatcher:
    """Finds stop strings in streamed text; holds back any tail that could start a stop string.

    Work is linear in the text pushed: one Knuth-Morris-Pratt automaton per stop string (Knuth, Morris, Pratt,
    "Fast pattern matching in strings", 1977) keeps the length of the longest prefix of that stop which ends the
    text so far, so a push of n characters costs O(n) steps per stop, whatever the stop lengths; only when an
    automaton completes a match is the held window (shorter than the longest stop plus the pushed text) searched
    to find the earliest stop. The held-back tail is the longest suffix that is a proper prefix of some stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: the length of its prefix that ends the text so far

    def _feed(self, text: str) -> bool:
        """Advance every automaton over ``text``; True when one completed a match."""
        hit = False
        for j, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            k, n = self._state[j], len(stop)
            for ch in text:
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                    if k == n:
                        hit = True
                        break
            self._state[j] = k
            if hit:
                break
        return hit

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit — text after it is dropped)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        if self._feed(text):
            cut = min(i for i in (buf.find(s) for s in self.stops) if i >= 0)
            self.pending, self._state = "", [0] * len(self.stops)
            return buf[:cut], True
        keep = max(self._state)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def finish(self, detok: Any) -> str:
        """At the end of generation: the detokenizer's held bytes (still checked for a stop string) and any
        held-back tail."""
        text, hit = self.push(detok.flush() if detok is not None else "")
        out, self.pending = self.pending, ""
        self._state = [0] * len(self.stops)
        return text if hit else text + out


def _failure(stop: str) -> list[int]:
    """KMP failure function: [len(stop)] int, entry i the length of the longest proper prefix of stop[:i + 1]
    that is also its suffix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail
