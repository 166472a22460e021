"""Speculator policy details: exploration probes when StairCut keeps choosing plain steps, and the auto mode's
fallback (the MTP head drafts only when prompt lookup found nothing)."""

from __future__ import annotations

from typing import Any

from tandem.spec.speculator import PROBE_MAX, PROBE_NODES, PROBE_START, Speculator
from tandem.spec.staircut import PriceCurve
from tandem.spec.tree import Fragment


class _Model:
    def new_tree_scratch(self, max_nodes: int) -> None:
        return None


class _Drafter:
    needs_hidden = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.calls = tokens, 0

    def reset(self, ids: list[int], hidden: Any = None, max_len: int = 0) -> None:
        pass

    def extend(self, ids: list[int], hidden: Any = None) -> None:
        pass

    def propose(self, root: int, max_nodes: int, max_depth: int) -> Fragment:
        self.calls += 1
        frag = Fragment()
        frag.add_chain(self.tokens[:max_depth], 0.01)
        return frag


def test_probe_schedule() -> None:
    spec = Speculator(_Model(), [], curve=PriceCurve([(1, 1.0), (2, 10.0)]))
    probes = []
    for r in range(200):
        probes.append(spec._explore(1, 10) > 1)
    gaps = [j - i for i, j in zip([-1] + [i for i, p in enumerate(probes) if p], [i for i, p in enumerate(probes) if p])]
    assert gaps[0] == PROBE_START and gaps[1] == 2 * PROBE_START and max(gaps) == PROBE_MAX
    assert spec._explore(1, 10) in (1, 1 + PROBE_NODES)
    assert spec._explore(5, 10) == 5 and spec.probe_every == PROBE_START  # StairCut speculating resets probes
    assert spec._explore(1, 1) == 1  # nothing to probe


def test_low_confidence_guesses_are_probed_then_verified_by_staircut_alone() -> None:
    # a steep price curve and tiny confidences: StairCut alone verifies nothing; probes still test guesses
    spec = Speculator(_Model(), [_Drafter([5, 6, 7])], curve=PriceCurve([(1, 1000.0), (2, 5000.0)]))
    sizes = [len(spec.draft(1, 8)) for _ in range(PROBE_START)]
    assert sizes[:-1] == [1] * (PROBE_START - 1) and sizes[-1] == 4


def test_auto_fallback_drafts_only_when_lookup_is_empty() -> None:
    cheap, costly = _Drafter([3, 4]), _Drafter([8, 9])
    spec = Speculator(_Model(), [cheap, costly], policy="all", fallback_from=1)
    tree = spec.draft(1, 8)
    assert costly.calls == 0 and tree.token_ids[1:] == [3, 4]
    cheap.tokens = []
    tree = spec.draft(1, 8)
    assert costly.calls == 1 and tree.token_ids[1:] == [8, 9]


def test_staircut_sizes_round_to_the_models_recorded_sizes() -> None:
    from types import SimpleNamespace

    from tandem.spec.speculator import Speculator

    spec = Speculator.__new__(Speculator)
    spec.model = SimpleNamespace(verify_sizes=(2, 3, 4, 6, 8, 12, 16))
    assert spec._recorded_size(1, 20) == 1  # a plain step stays one
    assert spec._recorded_size(5, 20) == 6 and spec._recorded_size(9, 20) == 12 and spec._recorded_size(8, 8) == 8
    assert spec._recorded_size(7, 7) == 6  # the tree fills no size >= 7: the largest it fills
    assert spec._recorded_size(20, 30) == 16
    spec.model = SimpleNamespace()
    assert spec._recorded_size(7, 9) == 7  # a model without recorded sizes (the CPU's) keeps StairCut's choice
