"""StairCut: how many tree nodes to verify this round (DESIGN.md, glossary).

A device's **price curve** gives verify ms as a function of the node count N (a staircase on a GPU: flat while
the batch fits the kernels' tiles, then a step; nearly a line on a CPU, where the per-row GEMVs scale with N).
With the tree's nodes ranked by estimated path probability, verifying the best N-1 guesses commits in
expectation ``1 + Σ p_i`` tokens; StairCut picks the N that maximises expected tokens per ms,
``(1 + Σ_{i<N} p_i) / (price(N) + draft_ms·[N > 1] + commit_ms·[N > 1])``. N = 1 is a plain decode step.

Curves come from ``tandem calibrate`` (profiles/<device>.json) or a built-in fallback shape, and are rescaled
online by the times the engine observes (an EMA of observed / predicted ms: a busier machine or another model moves
the curve, the calibrated shape stays). Plain steps (N = 1) and verifies (N > 1) keep separate scales, so a model
whose verify costs a different multiple of its step than the profile's model (a small model on a GPU, where both are
launch-bound: H200, embedded model, a 6-node verify 1.5 ms against a 0.26 ms step; the profile, measured at 27B,
says 1.4x) learns that ratio; the verify scale follows the plain one until a verify is observed.

Plain typed Python: compiled by mypyc (setup.py, MYPYC_MODULES).
"""

from __future__ import annotations

# Built-in fallback shape (the CPU reference: per-row GEMVs make each extra node cost most of a decode step):
# ms for a plain step, and the extra ms per verified node; the online scale fixes the absolute level.
FALLBACK_DECODE_MS = 1.0
FALLBACK_NODE_MS = 0.7


class PriceCurve:
    """Verify ms per node count N = 1..max_nodes (N = 1: a plain decode step).

    Args:
        points: (num_nodes, ms) pairs measured by calibration, any order; interpolated linearly in between and
            extrapolated from the last two points beyond. Empty: the built-in fallback line.
        max_nodes: the largest N priced.
        decay: weight of the past in ``observe``.
    Attributes: scale: online correction factor of the plain step's price (N = 1); verify_scale: of every verify
    price (N > 1), equal to ``scale`` until a verify has been observed.
    """

    def __init__(self, points: list[tuple[int, float]], max_nodes: int = 32, decay: float = 0.8) -> None:
        self.max_nodes = max(1, max_nodes)
        self.decay = decay
        pts = sorted((int(n), float(ms)) for n, ms in points if n >= 1)
        if not pts:
            pts = [(1, FALLBACK_DECODE_MS), (2, FALLBACK_DECODE_MS + FALLBACK_NODE_MS)]
        if len(pts) == 1:
            pts.append((pts[0][0] + 1, pts[0][1] + FALLBACK_NODE_MS))
        self.ms: list[float] = [0.0] + [_interpolate(pts, n) for n in range(1, self.max_nodes + 1)]
        self.scale = 1.0
        self.verify_scale = 1.0
        self.num_observed = 0  # plain steps observed
        self.num_verify_observed = 0

    def with_routing(self, experts: int, top_k: int, share: float) -> "PriceCurve":
        """Price verifies of a model whose rows each read ``top_k`` of ``experts`` routed experts' weights
        (``Capabilities.expert_routing``): an N-row verify reads the distinct experts its rows chose once, expected
        D(N) = X (1 − (1 − k/X)^N) for rows routed independently (an upper bound: a tree's rows share context and
        experts), so each ms[N], N > 1, gains ms[1] · share · (D(N)/k − 1), the bytes of the experts beyond a
        step's k (``share``: their fraction of a step). Returns self (the curve is changed in place)."""
        if experts >= top_k >= 1 and share > 0.0:
            for n in range(2, self.max_nodes + 1):
                self.ms[n] += self.ms[1] * share * (expected_distinct(experts, top_k, n) / top_k - 1.0)
        return self

    def price(self, num_nodes: int) -> float:
        """Estimated ms of verifying ``num_nodes`` nodes (clamped to 1..max_nodes)."""
        n = min(max(num_nodes, 1), self.max_nodes)
        scale = self.verify_scale if n > 1 and self.num_verify_observed else self.scale
        return scale * self.ms[n]

    def observe(self, num_nodes: int, ms: float) -> None:
        """Fold one measured round (``num_nodes`` verified in ``ms``; 1: a plain step) into its scale."""
        if 1 <= num_nodes <= self.max_nodes and ms > 0.0:
            ratio = ms / self.ms[num_nodes]
            if num_nodes == 1:
                d = self.decay if self.num_observed else 0.0  # the first observation sets the level
                self.scale = d * self.scale + (1.0 - d) * ratio
                self.num_observed += 1
            else:
                d = self.decay if self.num_verify_observed else 0.0
                self.verify_scale = d * self.verify_scale + (1.0 - d) * ratio
                self.num_verify_observed += 1


def expected_distinct(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts among ``rows`` rows that each choose ``top_k`` of ``experts`` uniformly and
    independently: X (1 − (1 − k/X)^N)."""
    return float(experts) * (1.0 - (1.0 - float(top_k) / float(experts)) ** rows)


def _interpolate(pts: list[tuple[int, float]], n: int) -> float:
    for j in range(1, len(pts)):
        if n <= pts[j][0] or j == len(pts) - 1:
            (n0, m0), (n1, m1) = pts[j - 1], pts[j]
            t = (n - n0) / (n1 - n0) if n1 != n0 else 0.0
            return max(1e-6, m0 + t * (m1 - m0))
    return pts[0][1]


def stair_cut(probs_ranked: list[float], curve: PriceCurve, draft_ms: float, commit_ms: float) -> int:
    """The node count N (1 = plain step) maximising expected committed tokens per ms.

    Args:
        probs_ranked: estimated acceptance probabilities of the guesses, best first (the tree's ranked order).
        draft_ms, commit_ms: the expected overheads of a speculative round (charged when N > 1).
    Returns: N in 1..min(len(probs_ranked) + 1, curve.max_nodes).
    """
    best_n = 1
    best_rate = 1.0 / curve.price(1)
    expected = 1.0
    limit = min(len(probs_ranked) + 1, curve.max_nodes)
    for n in range(2, limit + 1):
        expected += probs_ranked[n - 2]
        rate = expected / (curve.price(n) + draft_ms + commit_ms)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n
