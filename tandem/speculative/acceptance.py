"""Running acceptance estimates per drafter and depth, used to price draft trees (DESIGN.md, StairCut).

A guess is *tested* when its parent was accepted (the model's choice at the parent was computed); it is
*accepted* when that choice equals the guess. For each (drafter, depth) we keep exponential moving averages of
the acceptance indicator and of the drafter's own confidence over tested guesses; the estimated probability of a
new edge is ``min(1, confidence · acc / conf)``: the drafter's confidence, calibrated by how often guesses of
that drafter at that depth were right. A depth with no tested guess yet borrows the averages of the deepest tested
depth above it (the prior where there is none), and starts its own averages from them at its first tested guess.
Otherwise a depth StairCut had never verified kept the prior (0.5) and so stayed out of the trees: on the H200 at
the 27B shape, an oracle drafter right every time was verified about 6 nodes deep of its 8 (bench/spec_scale.py).

Plain typed Python: compiled by mypyc (setup.py, MYPYC_MODULES).
"""

from __future__ import annotations

from tandem.speculative.tree import DraftTree


class AcceptanceStats:
    """EMA acceptance rates indexed [source][depth - 1] (depths beyond ``max_depth`` share the last slot).

    Args:
        num_sources: number of drafters. max_depth: depth slots kept. prior: initial acceptance rate.
        decay: EMA weight of the past (0.9: about the last ten tested guesses count).
    """

    def __init__(self, num_sources: int, max_depth: int = 16, prior: float = 0.5, decay: float = 0.9) -> None:
        self.max_depth = max(1, max_depth)
        self.decay = decay
        self.acc: list[list[float]] = [[prior] * self.max_depth for _ in range(num_sources)]
        self.conf: list[list[float]] = [[1.0] * self.max_depth for _ in range(num_sources)]
        self.tested: list[list[bool]] = [[False] * self.max_depth for _ in range(num_sources)]
        self.num_tested = 0
        self.num_accepted = 0

    def _slot(self, depth: int) -> int:
        return min(max(depth, 1), self.max_depth) - 1

    def _source_slot(self, source: int, s: int) -> int:
        """The slot whose averages depth slot ``s`` uses: itself once tested, else the deepest tested slot above it
        (``s`` itself where there is none: the prior)."""
        tested = self.tested[source]
        if tested[s]:
            return s
        for t in range(s - 1, -1, -1):
            if tested[t]:
                return t
        return s

    def edge_prob(self, source: int, depth: int, confidence: float) -> float:
        """Estimated probability that a guess of ``source`` at ``depth`` with ``confidence`` is accepted."""
        s = self._source_slot(source, self._slot(depth))
        conf = self.conf[source][s]
        p = confidence * self.acc[source][s] / conf if conf > 1e-6 else self.acc[source][s]
        return min(1.0, max(0.0, p))

    def observe(self, source: int, depth: int, confidence: float, accepted: bool) -> None:
        """Record one tested guess."""
        s = self._slot(depth)
        if not self.tested[source][s]:  # its first: start from the averages it borrowed so far
            b = self._source_slot(source, s)
            self.acc[source][s], self.conf[source][s] = self.acc[source][b], self.conf[source][b]
            self.tested[source][s] = True
        d = self.decay
        self.acc[source][s] = d * self.acc[source][s] + (1.0 - d) * (1.0 if accepted else 0.0)
        self.conf[source][s] = d * self.conf[source][s] + (1.0 - d) * confidence
        self.num_tested += 1
        if accepted:
            self.num_accepted += 1

    def observe_round(self, tree: DraftTree, path: list[int]) -> None:
        """Record every tested guess of a verified tree: those whose parent lies on the accepted ``path``."""
        on_path = [False] * len(tree)
        for n in path:
            on_path[n] = True
        for i in range(1, len(tree)):
            if on_path[tree.parent_ids[i]] and tree.sources[i] >= 0:
                self.observe(tree.sources[i], tree.depths[i], tree.confidences[i], on_path[i])
