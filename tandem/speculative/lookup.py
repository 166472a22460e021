"""Lookup drafter: prompt lookup decoding (n-gram matching of the recent suffix against earlier text).

The context (prompt + committed output, ending with the round's root token) is indexed incrementally: for each
n in min_n..max_n, a dict maps an n-gram to the end positions of its most recent occurrences. A proposal takes
the longest suffix n-gram that occurred before, follows up to ``max_matches`` earlier occurrences, and merges
their continuations into a trie (branches where they disagree; an edge's confidence is the share of matches
that agree on it). Reference: Saxena, "Prompt Lookup Decoding" (2023); the n-gram drafter of vLLM.

Plain typed Python: compiled by mypyc (setup.py, MYPYC_MODULES).
"""

from __future__ import annotations

from tandem.speculative.tree import Fragment


class LookupDrafter:
    """Proposes continuations of earlier occurrences of the context's suffix.

    Args:
        min_n, max_n: n-gram lengths matched (longest first).
        max_matches: earlier occurrences followed per proposal (each may add a branch).
        max_depth: the longest continuation proposed.
    """

    name = "lookup"

    def __init__(self, min_n: int = 1, max_n: int = 4, max_matches: int = 4, max_depth: int = 24) -> None:
        self.min_n = max(1, min_n)
        self.max_n = max(self.min_n, max_n)
        self.max_matches = max(1, max_matches)
        self.max_depth = max(1, max_depth)
        self.ids: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}

    needs_hidden = False

    def reset(self, ids: list[int], hidden: object = None, max_len: int = 0) -> None:
        """Start a new sequence whose committed tokens are ``ids`` (``hidden``, ``max_len``: unused)."""
        self.ids = []
        self.index = {}
        self.extend(ids)

    def extend(self, ids: list[int], hidden: object = None) -> None:
        """Append committed tokens to the context and index the n-grams ending at each."""
        for t in ids:
            self.ids.append(t)
            end = len(self.ids) - 1
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 < n:
                    break
                key = tuple(self.ids[end + 1 - n:end + 1])
                ends = self.index.get(key)
                if ends is None:
                    self.index[key] = [end]
                else:
                    ends.append(end)
                    if len(ends) > 4 * self.max_matches:
                        del ends[:len(ends) - 2 * self.max_matches]

    def propose(self, root: int, max_nodes: int, max_depth: int) -> Fragment:
        """Guesses after the committed tokens and the pending ``root``: a trie of at most ``max_nodes`` nodes,
        ``max_depth`` deep."""
        frag = Fragment()
        depth = min(max_depth, self.max_depth)
        if depth <= 0 or max_nodes <= 0:
            return frag
        size = len(self.ids)
        for n in range(min(self.max_n, size + 1), self.min_n - 1, -1):
            key = tuple(self.ids[size + 1 - n:] + [root]) if n > 1 else (root,)
            ends = self.index.get(key)
            if ends is None:
                continue
            starts = [e + 1 for e in reversed(ends) if e + 1 < size][:self.max_matches]
            if starts:
                self._trie(frag, starts, max_nodes, depth)
                break
        return frag

    def _trie(self, frag: Fragment, starts: list[int], max_nodes: int, depth: int) -> None:
        """Merge the continuations at ``starts`` (most recent first) into ``frag``, best-supported first."""
        total = len(starts)
        # children[(fragment node)] -> {token: fragment node}; node -1 is the root
        children: dict[int, dict[int, int]] = {-1: {}}
        support: list[int] = []
        for s in starts:
            parent = -1
            for j in range(depth):
                pos = s + j
                if pos >= len(self.ids) or len(frag) >= max_nodes and self.ids[pos] not in children[parent]:
                    break
                tok = self.ids[pos]
                node = children[parent].get(tok, -1)
                if node < 0:
                    node = frag.add(parent, tok, 0.0)
                    children[parent][tok] = node
                    children[node] = {}
                    support.append(0)
                support[node] += 1
                parent = node
        for i in range(len(frag)):
            p = frag.parents[i]
            frag.confidences[i] = support[i] / (support[p] if p >= 0 else total)
