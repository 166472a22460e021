"""Speculator policy details: exploration probes when StairCut keeps choosing plain steps, and the auto mode's
fallback (the MTP head drafts only when prompt lookup found nothing)."""

from __future__ import annotations

from typing import Any

from tandem.models.protocol import Capabilities
from tandem.speculative.speculator import PROBE_MAX, PROBE_NODES, PROBE_START, Speculator
from tandem.speculative.staircut import PriceCurve
from tandem.speculative.tree import Fragment


class _Model:
    capabilities = Capabilities(tree_verify=True)

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

    from tandem.speculative.speculator import Speculator

    spec = Speculator.__new__(Speculator)
    spec.model = SimpleNamespace(capabilities=Capabilities(verify_sizes=(2, 3, 4, 6, 8, 12, 16)))
    assert spec._recorded_size(1, 20) == 1  # a plain step stays one
    assert spec._recorded_size(5, 20) == 6 and spec._recorded_size(9, 20) == 12 and spec._recorded_size(8, 8) == 8
    assert spec._recorded_size(7, 7) == 6  # the tree fills no size >= 7: the largest it fills
    assert spec._recorded_size(20, 30) == 16
    spec.model = SimpleNamespace(capabilities=Capabilities())
    assert spec._recorded_size(7, 9) == 7  # a model without recorded sizes (the CPU's) keeps StairCut's choice


def test_rounds_that_record_a_launch_plan_stay_out_of_the_prices(tmp_path: Any) -> None:
    """A device model records a launch plan the first time it verifies a tree size (or decodes on a new state);
    that round's time is far above a replay's. The engine leaves such rounds out of StairCut's prices (the
    acceptance estimates still learn from them), so one recording cannot make verifies look dear for the rest of
    the generation; the output stays the plain one."""
    import time
    from dataclasses import replace

    from spec_helpers import OracleDrafter
    from tandem.engine import Engine
    from tandem.sampling import SamplingParams
    from tools.make_checkpoint import write_checkpoint

    path = write_checkpoint(tmp_path, num_hidden_layers=2, full_attention_interval=2, init_std=0.1, seed=9,
                            num_shards=1)
    base = Engine.from_pretrained(path)

    class Recording:
        """The CPU model, recording (slowly) at the first verify of each tree size and the first decode."""

        def __init__(self, model: Any) -> None:
            self.model, self.plan_recordings = model, 0
            self.capabilities = replace(model.capabilities, plan_recordings=True)
            self.sizes: set[int] = set()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.model, name)

        def _record(self, key: int) -> None:
            if key not in self.sizes:
                self.sizes.add(key)
                self.plan_recordings += 1
                time.sleep(0.05)

        def verify_tree(self, state: Any, scratch: Any, token_ids: Any, parent_ids: Any) -> Any:
            self._record(len(token_ids))
            return self.model.verify_tree(state, scratch, token_ids, parent_ids)

        def decode(self, state: Any, token: Any, **kw: Any) -> Any:
            self._record(1)
            return self.model.decode(state, token, **kw)

        def commit(self, state: Any, scratch: Any, path: Any) -> Any:
            self._record(100 + len(path))  # a commit plan per path length
            return self.model.commit(state, scratch, path)

    class RecordingDrafter(OracleDrafter):
        """The oracle, recording (slowly) in its first proposal, as the device MTP head records its plans; every
        third proposal is empty, so some rounds are plain steps."""

        calls = 0

        def propose(self, root: int, max_nodes: int, max_depth: int) -> Any:
            model._record(-1)
            self.calls += 1
            return Fragment() if self.calls % 3 == 0 else super().propose(root, max_nodes, max_depth)

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = list(range(3, 30))
    want = base.complete(prompt, params).token_ids
    model = Recording(base.model)
    eng = Engine(model, None, None, max_context=256)
    drafter = RecordingDrafter({tuple(prompt): want}, base.vocab_size, depth=6)
    eng.speculator = spec = Speculator(model, [drafter], max_nodes=8, curve=PriceCurve([(1, 1.0), (8, 2.0)]))
    assert eng.complete(prompt, params).token_ids == want
    rounds = eng.last_stats.rounds
    trees, plain = [r for r in rounds if r.num_nodes > 1], [r for r in rounds if r.num_nodes == 1]
    curve = spec.curve
    verify_sizes = {k for k in model.sizes if 1 < k < 100}
    assert -1 in model.sizes and 1 in model.sizes and len(trees) > len(verify_sizes) and plain
    assert curve.num_verify_observed == len(trees) - len(verify_sizes)  # each size's first verify left out
    assert curve.num_observed == len(plain) - 1  # the first decode recorded its plan
    assert max(r.verify_ms for r in rounds) >= 50.0  # the recorded rounds did pay for it
    assert curve.verify_scale * curve.ms[8] < 50.0 and curve.scale * curve.ms[1] < 50.0  # the prices never took it
    assert max(r.draft_ms for r in rounds) >= 50.0 and spec.draft_ms < 10.0  # nor the draft's average
    assert max(r.commit_ms for r in trees) >= 50.0 and spec.commit_ms < 10.0  # nor the commit's
