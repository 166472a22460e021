"""Draft trees: the guesses one round verifies (DESIGN.md, "What runs, in one round").

Convention: node 0 is the round's **root**, the pending token (chosen from the last logits, emitted, but not yet
run through the model) at absolute position P = state.length. Every other node is a guess; ``parent_ids[i] < i``
(topological order), ``depths[i]`` is its position offset (the node runs at position P + depth), so node i's
logits predict the token at position P + depth + 1. A drafter returns a ``Fragment`` (edges hanging off the
root); fragments of several drafters merge into one tree, equal guesses under the same parent shared.

Plain typed Python (ints, floats, lists): compiled by mypyc (setup.py, MYPYC_MODULES).
"""

from __future__ import annotations

from collections.abc import Callable


class Fragment:
    """What a drafter proposes: nodes hanging off the root (parent -1) or off earlier fragment nodes.

    Attributes (parallel lists, one entry per proposed node, parents before children):
        parents: index of the parent inside this fragment, -1 for the root.
        token_ids: the guessed token.
        confidences: the drafter's own probability of the edge (0..1), e.g. a softmax probability or a match share.
    """

    def __init__(self) -> None:
        self.parents: list[int] = []
        self.token_ids: list[int] = []
        self.confidences: list[float] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(self, parent: int, token_id: int, confidence: float = 1.0) -> int:
        """Append a node under ``parent`` (-1 = root); returns its fragment index. Raises ValueError on a bad parent."""
        if not -1 <= parent < len(self.token_ids):
            raise ValueError(f"fragment parent {parent} must be -1 or an earlier node (< {len(self.token_ids)})")
        self.parents.append(parent)
        self.token_ids.append(token_id)
        self.confidences.append(confidence)
        return len(self.token_ids) - 1

    def add_chain(self, token_ids: list[int], confidence: float = 1.0, parent: int = -1) -> None:
        """Append a chain of guesses under ``parent`` (each node the parent of the next)."""
        for t in token_ids:
            parent = self.add(parent, t, confidence)


class DraftTree:
    """A tree of guesses after the root token (parallel lists indexed by node).

    Attributes:
        token_ids: [N] token of each node (node 0: the root, the pending token).
        parent_ids: [N] parent of each node, -1 for the root; parent_ids[i] < i.
        depths: [N] position offset from the root.
        sources: [N] index of the drafter that proposed the node (-1 for the root).
        probs: [N] estimated probability that the node is accepted (product along its path; 1.0 for the root).
        confidences: [N] the proposing drafter's own confidence in the edge into the node (1.0 for the root).
        children: [N] child node ids of each node.
    """

    def __init__(self, root_token: int) -> None:
        self.token_ids: list[int] = [root_token]
        self.parent_ids: list[int] = [-1]
        self.depths: list[int] = [0]
        self.sources: list[int] = [-1]
        self.probs: list[float] = [1.0]
        self.confidences: list[float] = [1.0]
        self.children: list[list[int]] = [[]]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        """The largest depth (0 for a root-only tree)."""
        return max(self.depths)

    def child_with(self, node: int, token_id: int) -> int:
        """The child of ``node`` holding ``token_id``, or -1."""
        for c in self.children[node]:
            if self.token_ids[c] == token_id:
                return c
        return -1

    def add(self, parent: int, token_id: int, prob: float, source: int, confidence: float = 1.0) -> int:
        """Add a guess under ``parent`` (an existing child with the same token is shared: its probability becomes
        the larger of the two). Returns the node id. Raises ValueError for a bad parent."""
        if not 0 <= parent < len(self.token_ids):
            raise ValueError(f"parent {parent} is not a node of the tree (size {len(self.token_ids)})")
        same = self.child_with(parent, token_id)
        if same >= 0:
            if prob > self.probs[same]:
                self.probs[same] = prob
                self.sources[same] = source
                self.confidences[same] = confidence
            return same
        node = len(self.token_ids)
        self.token_ids.append(token_id)
        self.parent_ids.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.sources.append(source)
        self.probs.append(prob)
        self.confidences.append(confidence)
        self.children.append([])
        self.children[parent].append(node)
        return node

    def merge(self, fragment: Fragment, source: int, edge_probs: list[float], max_depth: int,
              max_nodes: int) -> None:
        """Add a drafter's fragment; node j's path probability is its parent's times ``edge_probs[j]``.

        Nodes deeper than ``max_depth`` (and their subtrees), and nodes past ``max_nodes``, are dropped.
        """
        ids: list[int] = []
        for j in range(len(fragment)):
            p = fragment.parents[j]
            parent = 0 if p < 0 else ids[p]
            if parent < 0 or self.depths[parent] >= max_depth or len(self.token_ids) >= max_nodes:
                ids.append(-1)
                continue
            ids.append(self.add(parent, fragment.token_ids[j], self.probs[parent] * edge_probs[j], source,
                                fragment.confidences[j]))

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to ``node`` inclusive."""
        path: list[int] = []
        while node >= 0:
            path.append(node)
            node = self.parent_ids[node]
        path.reverse()
        return path

    def ranked(self) -> list[int]:
        """Non-root nodes by decreasing path probability, ties by node id.

        Every prefix of this order is closed under ancestors when a child's probability never exceeds its
        parent's (true for products of edge probabilities ≤ 1), so a prefix is a valid tree.
        """
        order = list(range(1, len(self.token_ids)))
        order.sort(key=lambda i: (-self.probs[i], i))
        return order

    def prefix(self, num_nodes: int) -> DraftTree:
        """The sub-tree of the root plus the ``num_nodes - 1`` best-ranked guesses, renumbered in the same
        topological order. A guess whose parent is not kept is dropped (cannot happen for product probabilities).
        """
        return self.subtree(sorted(self.ranked()[:max(0, num_nodes - 1)]))

    def pruned(self, valid_prefix: Callable[[list[int]], int]) -> DraftTree:
        """The sub-tree of guesses a constraint allows: ``valid_prefix(tokens)`` says how many leading tokens of a
        path's guesses (root excluded) the constraint accepts; a node is kept when its whole path is accepted.
        """
        keep = [False] * len(self.token_ids)
        for leaf in range(1, len(self.token_ids)):
            if self.children[leaf]:
                continue
            path = self.path_to(leaf)[1:]
            ok = valid_prefix([self.token_ids[n] for n in path])
            for n in path[:ok]:
                keep[n] = True
        return self.subtree([i for i in range(1, len(self.token_ids)) if keep[i]])

    def subtree(self, keep: list[int]) -> DraftTree:
        """The root plus the guesses ``keep`` (ascending node ids), renumbered in the same topological order;
        a guess whose parent is not kept is dropped."""
        out = DraftTree(self.token_ids[0])
        new_id: dict[int, int] = {0: 0}
        for i in keep:
            parent = new_id.get(self.parent_ids[i], -1)
            if parent < 0:
                continue
            new_id[i] = out.add(parent, self.token_ids[i], self.probs[i], self.sources[i], self.confidences[i])
        return out

    def expected_tokens(self) -> float:
        """Expected tokens a round commits: 1 (the bonus token) plus the sum of the guesses' probabilities."""
        return 1.0 + sum(self.probs[1:])
