"""A made-up third architecture for tests/test_registry.py: a counting model served through the registry.

Its "weights" are one JSON file; the next token after t is (t + step) mod V, so every output is predictable.
It has the adapter verbs the engine uses (load, hp, new_state, prefill, decode) and nothing else: the engine must
serve it with no edit outside this file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.models.state import BufferSpec, ModelState


@dataclass(frozen=True)
class ToyHParams:
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    step: int


class ToyModel:
    """Logits put 1.0 on (last token + step) mod V and 0 elsewhere; the state keeps every token in a view."""

    def __init__(self, hp: ToyHParams) -> None:
        self.hp = hp
        self.decode_calls = 0

    @classmethod
    def load(cls, path: str | Path, progress: Callable[[int], None] | None = None) -> "ToyModel":
        cfg = json.loads((Path(path) / "config.json").read_text())
        weights = json.loads((Path(path) / "toy_weights.json").read_text())
        if progress is not None:
            progress(1)
        return cls(ToyHParams(int(cfg["vocab_size"]), int(cfg["max_position_embeddings"]),
                              tuple(cfg.get("eos_token_ids", ())), int(weights["step"])))

    def new_state(self, max_len: int) -> ModelState:
        return ModelState([BufferSpec("tokens", (max_len,), "int64", "view")], max_len)

    def _logits(self, last: int) -> np.ndarray:
        out = np.zeros(self.hp.vocab_size, dtype=np.float32)
        out[(last + self.hp.step) % self.hp.vocab_size] = 1.0
        return out

    def prefill(self, state: ModelState, ids: Sequence[int]) -> np.ndarray:
        if state.length + len(ids) > state.max_len:
            raise ValueError("state full")
        state.buffers["tokens"][state.length:state.length + len(ids)] = ids
        state.length += len(ids)
        return self._logits(int(ids[-1]))

    def decode(self, state: ModelState, token: int) -> np.ndarray:
        self.decode_calls += 1
        return self.prefill(state, [token])
