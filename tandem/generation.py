"""What a generation yields: per-round chunks, statistics, the whole completion, and the constraint protocol.

These are the engine's output types (tandem/engine.py) shared by the server and the speculative loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class TokenLogprob:
    """Log-probability of a generated token and the top alternatives (ids, natural log)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RoundStats:
    """One round: tokens it committed (emitted), nodes verified (1 = a plain decode step) and times in ms."""

    num_tokens: int
    num_nodes: int
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0


@dataclass
class GenerationStats:
    """Rounds of one generation (prefill's first token is not a round)."""

    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        """Number of rounds."""
        return len(self.rounds)

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens committed per round (0.0 without rounds)."""
        return sum(r.num_tokens for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    def totals_ms(self) -> dict[str, float]:
        """Total draft, verify and commit ms."""
        return {"draft_ms": sum(r.draft_ms for r in self.rounds), "verify_ms": sum(r.verify_ms for r in self.rounds),
                "commit_ms": sum(r.commit_ms for r in self.rounds)}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary: rounds, tokens_per_round, nodes_per_round, total ms."""
        nodes = sum(r.num_nodes for r in self.rounds)
        return {"rounds": self.num_rounds, "tokens_per_round": self.tokens_per_round,
                "nodes_per_round": nodes / self.num_rounds if self.rounds else 0.0, **self.totals_ms()}


@dataclass
class GenerationChunk:
    """What one round commits: new token ids, the new text (complete UTF-8, stop strings held back) and, on the
    last chunk, why generation ended ("stop": an eos id or a stop string; "length": max_tokens or the context).
    ``stats``: the round's stats (None for the chunk of prefill's first token).
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: RoundStats | None = None


@dataclass
class Completion:
    """A whole generation: prompt and output ids, text, finish reason and timing (seconds)."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float
    decode_s: float
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: GenerationStats | None = None


class Constraint(Protocol):
    """A token-level constraint (a grammar) that masks the logits of each generated position.

    ``allowed()`` returns a [V] bool mask of the tokens allowed next (None: no restriction); ``advance(token)``
    consumes the chosen token. The engine applies the mask before sampling, so masked tokens are never drawn.
    Optional: ``valid_prefix(tokens) -> int``, how many leading tokens of a draft path the constraint would
    accept from its current state, without consuming them; speculation uses it to prune draft nodes.
    """

    def allowed(self) -> np.ndarray | None: ...

    def advance(self, token_id: int) -> None: ...


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the context for a generated token."""

