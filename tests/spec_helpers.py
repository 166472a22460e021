"""Test drafters for speculation: an oracle (the plain continuation, computed beforehand), garbage, and noisy trees
mixing both in chains, bushes and mixed shapes."""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.engine import Engine
from tandem.speculative.speculator import Drafter, Speculator
from tandem.speculative.tree import Fragment


class OracleDrafter:
    """Proposes the plain output's next tokens (all accepted), optionally corrupted and bushy.

    Args:
        outputs: prompt tuple -> the plain output ids for it (the generation under test must use one of them).
        depth: chain length. corrupt: probability that a guess is replaced by garbage (the chain continues).
        siblings: garbage siblings added under each chain node. seed: the noise's seed.
    """

    name = "oracle"
    needs_hidden = False

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], vocab: int, depth: int = 8, corrupt: float = 0.0,
                 siblings: int = 0, seed: int = 0) -> None:
        self.outputs, self.vocab, self.depth = outputs, vocab, depth
        self.corrupt, self.siblings = corrupt, siblings
        self.rng = np.random.default_rng(seed)
        self.output: list[int] = []
        self.done = 0  # output tokens committed to the state

    def reset(self, ids: list[int], hidden: Any = None, max_len: int = 0) -> None:
        self.output = self.outputs[tuple(ids)]
        self.done = 0

    def extend(self, ids: list[int], hidden: Any = None) -> None:
        self.done += len(ids)

    def propose(self, root: int, max_nodes: int, max_depth: int) -> Fragment:
        frag = Fragment()
        assert self.output[self.done] == root, "the root must be the plain output's next token"
        parent = -1
        for tok in self.output[self.done + 1:self.done + 1 + min(self.depth, max_depth)]:
            if len(frag) >= max_nodes:
                break
            for _ in range(self.siblings):
                if len(frag) < max_nodes - 1:
                    frag.add(parent, int(self.rng.integers(0, self.vocab)), 0.1)
            guess = int(self.rng.integers(0, self.vocab)) if self.rng.random() < self.corrupt else tok
            parent = frag.add(parent, guess, 0.9)
        return frag


class GarbageDrafter:
    """Random guesses in a random shape (chain, bush or mixed): almost never accepted."""

    name = "garbage"
    needs_hidden = False

    def __init__(self, vocab: int, num_nodes: int = 6, shape: str = "mixed", seed: int = 0) -> None:
        self.vocab, self.num_nodes, self.shape = vocab, num_nodes, shape
        self.rng = np.random.default_rng(seed)
        self.depth_of: list[int] = []

    def reset(self, ids: list[int], hidden: Any = None, max_len: int = 0) -> None:
        pass

    def extend(self, ids: list[int], hidden: Any = None) -> None:
        pass

    def propose(self, root: int, max_nodes: int, max_depth: int) -> Fragment:
        frag = Fragment()
        depth: list[int] = []
        for i in range(min(self.num_nodes, max_nodes)):
            if self.shape == "chain":
                parent = i - 1
            elif self.shape == "bush":
                parent = -1
            else:
                parent = int(self.rng.integers(-1, i))
            d = 1 if parent < 0 else depth[parent] + 1
            if d > max_depth:
                break
            depth.append(d)
            frag.add(parent, int(self.rng.integers(0, self.vocab)), 0.5)
        return frag


def speculating(engine: Engine, drafters: list[Drafter], max_nodes: int = 32, policy: str = "all") -> Engine:
    """The same model and tokenizer with a speculator of the given drafters."""
    other = Engine(engine.model, engine.tokenizer, engine.chat_template, engine.max_context, engine.eos_token_ids,
                   engine.name)
    other.speculator = Speculator(engine.model, drafters, max_nodes=max_nodes, policy=policy)
    return other
