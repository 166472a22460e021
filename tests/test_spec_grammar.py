"""Speculation under a constraint (a grammar): every choice is masked exactly as in a plain round, so the output is
identical to plain constrained decoding, and draft nodes the constraint would never allow are pruned before
verify."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spec_helpers import GarbageDrafter, OracleDrafter, speculating
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tandem.server.constraint import GrammarConstraint
from tandem.server.grammar import GrammarCompiler, json_grammar
from tandem.speculative.tree import DraftTree

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "s": {"type": "string", "maxLength": 5}},
          "required": ["n", "s"], "additionalProperties": False}


class EvenAfterOdd:
    """A toy constraint: after an odd token only even tokens are allowed (and vice versa is free)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.last = vocab, 0
        self.mask_even = np.arange(vocab) % 2 == 0

    def allowed(self) -> np.ndarray | None:
        return self.mask_even if self.last % 2 else None

    def advance(self, token_id: int) -> None:
        self.last = token_id

    def valid_prefix(self, tokens: list[int]) -> int:
        last = self.last
        for n, t in enumerate(tokens):
            if last % 2 and t % 2:
                return n
            last = t
        return len(tokens)


@pytest.fixture(scope="module")
def engine(served_model: Path) -> Engine:
    return Engine.from_pretrained(served_model)


def _grammar(engine: Engine, compiler: GrammarCompiler, max_tokens: int) -> GrammarConstraint:
    assert engine.tokenizer is not None
    return GrammarConstraint(compiler.matcher(json_grammar(SCHEMA), "test"), compiler, in_reasoning=False,
                             think_end_id=engine.tokenizer.token_id("</think>"), budget_tokens=max_tokens,
                             reserve_tokens=max_tokens)


def test_pruned_tree_keeps_only_allowed_paths() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        tree = DraftTree(int(rng.integers(0, 50)))
        for _ in range(int(rng.integers(1, 30))):
            tree.add(int(rng.integers(0, len(tree))), int(rng.integers(0, 50)), 0.5, 0)
        con = EvenAfterOdd(50)
        con.advance(tree.token_ids[0])
        pruned = tree.pruned(con.valid_prefix)
        for node in range(1, len(pruned)):
            path = [pruned.token_ids[n] for n in pruned.path_to(node)[1:]]
            assert con.valid_prefix(path) == len(path)
        kept = sum(1 for node in range(1, len(tree))
                   if con.valid_prefix([tree.token_ids[n] for n in tree.path_to(node)[1:]]) == tree.depths[node])
        assert len(pruned) == 1 + kept


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_toy_constraint_spec_equals_plain(engine: Engine, temperature: float) -> None:
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, engine.vocab_size, 12)] for s in range(8)]
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=48, ignore_eos=True)
    plain = {tuple(p): engine.complete(p, params, constraint=EvenAfterOdd(engine.vocab_size)).token_ids
             for p in prompts}
    for out in plain.values():
        assert all(not (a % 2 and b % 2) for a, b in zip(out, out[1:]))
    for drafters in ([OracleDrafter(plain, engine.vocab_size, depth=6, siblings=2, seed=1)],
                     [GarbageDrafter(engine.vocab_size, num_nodes=8, seed=2)]):
        spec = speculating(engine, drafters)  # type: ignore[list-item]
        for p in prompts:
            done = spec.complete(p, params, constraint=EvenAfterOdd(engine.vocab_size))
            assert done.token_ids == plain[tuple(p)]


def test_json_grammar_spec_equals_plain_and_prunes(engine: Engine) -> None:
    assert engine.tokenizer is not None
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    prompts = [engine.encode_prompt(t) for t in ("x", "answer:", "{", "json please")]
    outs: dict[tuple[int, ...], list[int]] = {}
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80)
        for p in prompts:
            done = engine.complete(p, params, constraint=_grammar(engine, compiler, 80))
            assert done.finish_reason == "stop"
            json.loads(done.text)
            outs[tuple(p)] = done.token_ids
        oracle = speculating(engine, [OracleDrafter(outs, engine.vocab_size, depth=8, siblings=1, seed=seed)])
        garbage = speculating(engine, [GarbageDrafter(engine.vocab_size, num_nodes=12, seed=seed)])
        for p in prompts:
            a = oracle.complete(p, params, constraint=_grammar(engine, compiler, 80))
            assert a.token_ids == outs[tuple(p)]
            assert a.stats is not None and max(r.num_tokens for r in a.stats.rounds) > 1
            b = garbage.complete(p, params, constraint=_grammar(engine, compiler, 80))
            assert b.token_ids == outs[tuple(p)]
            # random guesses rarely fit a JSON grammar: most rounds verify the root alone after pruning
            assert b.stats is not None
            assert np.mean([r.num_nodes for r in b.stats.rounds]) < 3
