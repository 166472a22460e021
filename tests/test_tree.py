"""Draft trees: merging fragments, sharing equal guesses, ranked prefixes closed under ancestors; the lookup
drafter's n-gram proposals."""

from __future__ import annotations

import numpy as np

from tandem.speculative.lookup import LookupDrafter
from tandem.speculative.tree import DraftTree, Fragment


def test_merge_shares_equal_guesses_and_respects_limits() -> None:
    tree = DraftTree(7)
    a = Fragment()
    a.add_chain([1, 2, 3])
    b = Fragment()
    x = b.add(-1, 1, 0.5)
    b.add(x, 9, 0.5)
    tree.merge(a, 0, [0.9, 0.9, 0.9], max_depth=8, max_nodes=32)
    tree.merge(b, 1, [0.5, 0.5], max_depth=8, max_nodes=32)
    assert tree.token_ids == [7, 1, 2, 3, 9]
    assert tree.parent_ids == [-1, 0, 1, 2, 1]
    assert tree.depths == [0, 1, 2, 3, 2]
    assert tree.child_with(1, 9) == 4 and tree.child_with(1, 5) == -1
    short = DraftTree(7)
    short.merge(a, 0, [0.9, 0.9, 0.9], max_depth=2, max_nodes=32)
    assert short.token_ids == [7, 1, 2]
    assert tree.path_to(3) == [0, 1, 2, 3]


def test_ranked_prefixes_are_trees() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        tree = DraftTree(0)
        for i in range(1, 30):
            parent = int(rng.integers(0, i))
            tree.add(parent, i, tree.probs[parent] * float(rng.random()), 0)
        for n in range(1, 31):
            sub = tree.prefix(n)
            assert len(sub) == n
            assert all(0 <= sub.parent_ids[i] < i for i in range(1, n))
            kept = sorted(tree.probs[1:], reverse=True)[:n - 1]
            assert abs(sub.expected_tokens() - 1 - sum(kept)) < 1e-9


def test_lookup_proposes_continuations_of_earlier_matches() -> None:
    d = LookupDrafter(min_n=1, max_n=3, max_matches=4, max_depth=8)
    d.reset([5, 1, 2, 3, 4, 9, 1, 2, 3, 8, 6])
    frag = d.propose(1, 16, 8)  # context ... 6, [1]: the 1-gram (1) matched; most recent continuation first
    assert frag.token_ids[:4] == [2, 3, 8, 6]
    assert 4 in frag.token_ids  # the older match branches off at the disagreement
    d.extend([1, 2])
    frag = d.propose(3, 16, 3)  # suffix (1, 2, 3) seen twice: continuations 8 and 4 as two branches
    assert sorted(frag.token_ids[i] for i in range(len(frag)) if frag.parents[i] == -1) == [4, 8]
    assert all(c <= 1.0 for c in frag.confidences)
    assert len(d.propose(77, 16, 8)) == 0  # an unseen token: nothing to propose
    assert len(d.propose(1, 0, 8)) == 0
