"""MTP drafter: chains the checkpoint's multi-token-prediction head (spec/qwen3_5.md §8) k steps deep.

The head's row t consumes (token_{t+1}, h_t): the token after position t and the target's post-final-norm hidden
state at t. Rows of committed positions are exact (the target's hidden states); a proposal then runs the row of
the last committed position with the pending root token, and chains: each further step feeds the previous draft
token and the head's own output hidden state one position later. Where the head is unsure (the runner-up's
probability ≥ ``branch_ratio`` × the best), the runners-up are added as sibling leaves (top-2/3 branching).
Speculative rows live past the committed rows of the head's cache and are overwritten by the next proposal.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from tandem.models.protocol import ChainingDraftHead, DraftHead
from tandem.speculative.tree import Fragment


class MTPDrafter:
    """Drafts with an adapter's ``draft_heads()`` object (``new_state``, ``forward``, ``top_probs``): the host
    head (tandem/models/qwen3_5/mtp.py) or the device one (cuda_mtp.py, whose hidden states stay on the device).

    Args: head: the MTP head. steps: chain length k. branch_ratio, max_branch: sibling leaves per step (capped at the
    head's ``max_top_k`` where it declares one: the device head's top-k kernel returns at most 4 ids).
    A head that ``chains`` (the device head) runs the whole chain with one host read and gives the drafts of the
    row-by-row loop (``device_chain``, initially the head's ``chains``: False takes the loop). It runs min(steps,
    max_depth, max_nodes, the cache's room) rows, where the loop stops as soon as the tree is full: with branching
    and a small ``max_nodes`` the chain may run a row or two whose guesses are not used (their cache rows are
    overwritten later).
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, head: DraftHead, steps: int = 4, branch_ratio: float = 0.5, max_branch: int = 3) -> None:
        self.head = head
        self.steps = max(1, steps)
        self.branch_ratio = branch_ratio
        cap = head.max_top_k
        self.max_branch = max(1, min(max_branch, cap if cap is not None else max_branch))
        self.device_chain = head.chains  # a head that chains (the device head) runs the chain with one host read
        self.state: Any = None
        self.filled = 0  # head rows 0..filled-1 hold committed positions
        self.last_hidden: np.ndarray | None = None  # [E] the target's hidden state at the last committed position
        self.pending_tokens: list[int] = []
        self.pending_hidden: list[np.ndarray] = []

    def reset(self, ids: list[int], hidden: np.ndarray | None = None, max_len: int = 0) -> None:
        """A new sequence: committed ``ids`` [T] with the target's hidden states ``hidden`` [T, E]."""
        if hidden is None or len(hidden) != len(ids):
            raise ValueError("the MTP drafter needs the target's hidden state of every committed token")
        capacity = max(max_len, len(ids)) + self.steps + 2
        if self.state is None or self.state.max_len < capacity:
            self.state = self.head.new_state(capacity)
        self.state.length = 0
        self.filled = 0
        self.pending_tokens = list(ids[1:])
        self.pending_hidden = [hidden[t] for t in range(len(ids) - 1)]
        self.last_hidden = np.array(hidden[-1])

    def extend(self, ids: list[int], hidden: np.ndarray | None = None) -> None:
        """Committed tokens ``ids`` [k] with their target hidden states [k, E]."""
        if hidden is None or len(hidden) != len(ids) or self.last_hidden is None:
            raise ValueError("the MTP drafter needs the target's hidden state of every committed token")
        for t in range(len(ids)):
            self.pending_tokens.append(ids[t])
            self.pending_hidden.append(self.last_hidden)
            self.last_hidden = np.array(hidden[t])

    def _catch_up(self) -> None:
        for a in range(0, len(self.pending_tokens), 64):
            toks = self.pending_tokens[a:a + 64]
            self.head.forward(self.state, toks, np.stack(self.pending_hidden[a:a + 64]), self.filled)
            self.filled += len(toks)
        self.pending_tokens, self.pending_hidden = [], []

    def propose(self, root: int, max_nodes: int, max_depth: int) -> Fragment:
        """A chain of up to ``steps`` guesses after ``root`` (plus sibling leaves where the head is unsure)."""
        frag = Fragment()
        if max_nodes <= 0 or max_depth <= 0 or self.last_hidden is None:
            return frag
        self._catch_up()
        chain = cast(ChainingDraftHead, self.head).chain if self.device_chain else None
        if chain is not None:
            n = min(self.steps, max_depth, max_nodes, self.state.max_len - self.filled)
            got = chain(self.state, root, self.last_hidden[None], self.filled, n, self.max_branch) if n > 0 else None
            if got is not None:
                self._add_steps(frag, got[0], got[1], max_nodes)
                self.state.length = self.filled
                return frag
        token, h, parent = root, self.last_hidden[None], -1
        for step in range(min(self.steps, max_depth)):
            if self.filled + step >= self.state.max_len or len(frag) >= max_nodes:
                break
            h = self.head.forward(self.state, [token], h, self.filled + step)
            top, probs = self.head.top_probs(h, self.max_branch)
            best = frag.add(parent, int(top[0]), float(probs[0]))
            for alt, p in zip(top[1:], probs[1:]):
                if p > 0 and p >= self.branch_ratio * probs[0] and len(frag) < max_nodes:  # no id past V
                    frag.add(parent, int(alt), float(p))
            token, parent = int(top[0]), best
        self.state.length = self.filled
        return frag

    def _add_steps(self, frag: Fragment, ids: np.ndarray, probs: np.ndarray, max_nodes: int) -> None:
        """A device chain's rows (ids [n, k], probs [n, k]) into ``frag`` as the row-by-row loop adds them: each
        row's best id on the chain, its runners-up as sibling leaves, until ``max_nodes``."""
        parent = -1
        for step in range(len(ids)):
            if len(frag) >= max_nodes:
                break
            top, p = ids[step], probs[step]
            best = frag.add(parent, int(top[0]), float(p[0]))
            for alt, q in zip(top[1:], p[1:]):
                if q > 0 and q >= self.branch_ratio * p[0] and len(frag) < max_nodes:  # no id past V
                    frag.add(parent, int(alt), float(q))
            parent = best
