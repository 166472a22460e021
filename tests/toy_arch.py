"""A made-up third architecture for tests/test_registry.py and tests/test_toy_arch_server.py: a counting model
served through the registry.

Its "weights" are one JSON file; the next token after t is (t + step) mod V, so every output is predictable.
It has the verbs of the model contract (tandem/models/protocol.py): ``load`` on the class, ``hp``, ``capabilities``,
``new_state``, ``prefill``, ``decode``, and the tree-verify capability (``new_tree_scratch``, ``verify_tree``,
``commit``) so it speculates; nothing else: the engine and the server must serve it with no edit outside this file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.models.protocol import Capabilities
from tandem.models.state import BufferSpec, ModelState


@dataclass(frozen=True)
class ToyHParams:
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    step: int


@dataclass
class ToyScratch:
    """The last verified tree: its tokens and parents, at the state's length ``start``."""

    max_nodes: int
    token_ids: list[int]
    parent_ids: list[int]
    start: int = 0
    hidden: Any = None


class ToyModel:
    """Logits put 1.0 on (last token + step) mod V and 0 elsewhere; the state keeps every token in a view."""

    capabilities = Capabilities(tree_verify=True)

    def __init__(self, hp: ToyHParams) -> None:
        self.hp = hp
        self.decode_calls = 0
        self.verify_calls = 0

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

    def prefill(self, state: ModelState, ids: Sequence[int], *, hidden_out: list[Any] | None = None) -> np.ndarray:
        if hidden_out is not None:
            raise ValueError("the toy has no hidden states (no draft heads)")
        if not ids or state.length + len(ids) > state.max_len:
            raise ValueError("no ids, or the state is full")
        if any(not 0 <= int(t) < self.hp.vocab_size for t in ids):
            raise ValueError("token id outside the vocabulary")
        state.buffers["tokens"][state.length:state.length + len(ids)] = ids
        state.length += len(ids)
        return self._logits(int(ids[-1]))

    def decode(self, state: ModelState, token: int, *, hidden_out: list[Any] | None = None) -> np.ndarray:
        self.decode_calls += 1
        return self.prefill(state, [token], hidden_out=hidden_out)

    def new_tree_scratch(self, max_nodes: int) -> ToyScratch:
        return ToyScratch(max_nodes, [], [])

    def verify_tree(self, state: ModelState, scratch: ToyScratch, token_ids: Sequence[int],
                    parent_ids: Sequence[int]) -> np.ndarray:
        """Row i: the logits after node i (they depend on its token only, as a decode of it would)."""
        n = len(token_ids)
        if not 0 < n <= scratch.max_nodes or len(parent_ids) != n or parent_ids[0] != -1 \
                or any(not 0 <= parent_ids[i] < i for i in range(1, n)):
            raise ValueError("malformed tree")
        if state.length + n > state.max_len:
            raise ValueError("the tree does not fit the state")
        scratch.token_ids, scratch.parent_ids, scratch.start = list(token_ids), list(parent_ids), state.length
        self.verify_calls += 1
        return np.stack([self._logits(int(t)) for t in token_ids])

    def commit(self, state: ModelState, scratch: ToyScratch, path: Sequence[int]) -> None:
        if state.length != scratch.start or not path or path[0] != 0 \
                or any(scratch.parent_ids[path[j]] != path[j - 1] for j in range(1, len(path))):
            raise ValueError("not a root-to-node path of the last verify")
        tokens = [scratch.token_ids[i] for i in path]
        state.buffers["tokens"][state.length:state.length + len(tokens)] = tokens
        state.length += len(tokens)


if TYPE_CHECKING:  # mypy tests/toy_arch.py: the toy satisfies the model contract
    from tandem.models.protocol import SpeculativeModel

    def _satisfies_the_contract(model: ToyModel) -> SpeculativeModel[ModelState, ToyScratch]:
        return model
