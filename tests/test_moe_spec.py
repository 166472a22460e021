"""Speculation on the MoE adapters (NumPy, CPU): the dense model's verify/commit path serves them unchanged.

- verify_tree rows equal, bit for bit, a plain decode of each node's path (chains, bushes, mixed trees), and
  commit leaves decode's state: the sparse MLP is row-invariant (per-row GEMVs, per-row routing);
- greedy speculative output == plain for lookup, the checkpoint's MTP head (a MoE layer), an always-right
  oracle, garbage, noisy trees; seeded sampling with an oracle and noisy trees == plain.
Both architectures: Qwen3.5-MoE (VLM layout, fused experts) and Qwen3-Next (per-expert, a dense layer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from device_helpers import assert_states_equal
from spec_helpers import GarbageDrafter, OracleDrafter, speculating
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tandem.speculative.lookup import LookupDrafter
from tandem.speculative.mtp_drafter import MTPDrafter
from test_spec_verify import clone, path_of, prefilled, random_tree
from tools.make_moe_checkpoint import write_moe_checkpoint

NUM_PROMPTS, NEW_TOKENS = 8, 64  # half of them repeated text (lookup finds it), half not
ARCHS = {
    "qwen3_5_moe": dict(arch="qwen3_5_moe", experts="fused", num_experts=6, num_experts_per_tok=2),
    "qwen3_next": dict(arch="qwen3_next", experts="per_expert", num_experts=5, num_experts_per_tok=3,
                       mlp_only_layers=(1,)),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    # three layers (two GDN, one attention) keep the prompts x tokens x drafters quick
    path = write_moe_checkpoint(tmp_path_factory.mktemp(request.param), num_hidden_layers=3,
                                full_attention_interval=3, seed=9, **ARCHS[request.param])
    return Engine.from_pretrained(path)


def _prompts(vocab: int, seed: int, num: int = NUM_PROMPTS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        ids = rng.integers(0, vocab, int(rng.integers(1, 50))).tolist()
        out.append(ids * 3 if i % 2 else ids)
    return out


@pytest.fixture(scope="module")
def greedy(engine: Engine) -> dict[tuple[int, ...], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return {tuple(p): engine.complete(p, params).token_ids for p in _prompts(engine.vocab_size, 1)}


@pytest.mark.parametrize("shape", ["chain", "bush", "mixed"])
def test_verify_rows_equal_decode_and_commit(engine: Engine, shape: str) -> None:
    model = engine.model
    rng = np.random.default_rng({"chain": 1, "bush": 2, "mixed": 3}[shape])
    scratch = model.new_tree_scratch(24)
    for _ in range(4):
        state, root = prefilled(model, rng)
        n = int(rng.integers(2, 25))
        parents = random_tree(rng, n, shape)
        tokens = [root] + rng.integers(0, model.hp.vocab_size, n - 1).tolist()
        before = clone(model, state)
        logits = model.verify_tree(state, scratch, tokens, parents)
        assert_states_equal(state, before)
        ends = {}
        for node in range(n):
            ref_state = clone(model, before)
            for t in [tokens[m] for m in path_of(parents, node)]:
                ref = model.decode(ref_state, t)
            assert np.array_equal(logits[node], ref), f"{shape}: node {node} logits differ from decode"
            ends[node] = ref_state
        node = int(rng.integers(0, n))
        model.commit(state, scratch, path_of(parents, node))
        assert_states_equal(state, ends[node])


def _drafters(name: str, engine: Engine, outputs: dict[tuple[int, ...], list[int]]) -> list[Any]:
    v = engine.vocab_size
    return {
        "lookup": lambda: [LookupDrafter()],
        "mtp": lambda: [MTPDrafter(engine.model.draft_heads(), steps=3, max_branch=2)],
        "oracle": lambda: [OracleDrafter(outputs, v, depth=12)],
        "garbage_bush": lambda: [GarbageDrafter(v, 3, "bush", seed=1)],
        "noisy_tree": lambda: [OracleDrafter(outputs, v, depth=10, corrupt=0.15, siblings=1, seed=2),
                               GarbageDrafter(v, 4, "mixed", seed=3)],
    }[name]()


@pytest.mark.parametrize("name", ["lookup", "mtp", "oracle", "garbage_bush", "noisy_tree"])
def test_greedy_spec_equals_plain(engine: Engine, greedy: dict[tuple[int, ...], list[int]], name: str) -> None:
    if name == "mtp":
        assert engine.model.draft_heads() is not None  # the checkpoint's MoE MTP layer
    spec = speculating(engine, _drafters(name, engine, greedy), max_nodes=24)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = rounds = 0
    for prompt, ref in greedy.items():
        done = spec.complete(list(prompt), params)
        assert done.token_ids == ref, f"{name}: differs at {next(i for i, (a, b) in enumerate(zip(done.token_ids, ref)) if a != b)}"
        assert done.stats is not None
        tokens += sum(r.num_tokens for r in done.stats.rounds)
        rounds += done.stats.num_rounds
    print(f"\n[{name}] {tokens / rounds:.2f} tokens per round")
    if name == "oracle":
        assert tokens / rounds > 10


def test_sampled_spec_equals_plain(engine: Engine) -> None:
    outputs: dict[tuple[int, ...], list[int]] = {}
    cases = []
    for i, prompt in enumerate(_prompts(engine.vocab_size, 2, 10)):
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=0 if i % 2 else 40, repetition_penalty=1.1,
                                seed=i, max_tokens=40, ignore_eos=True)
        outputs[tuple(prompt)] = engine.complete(prompt, params).token_ids
        cases.append((prompt, params))
    v = engine.vocab_size
    for drafters in ([OracleDrafter(outputs, v, depth=12)],
                     [OracleDrafter(outputs, v, depth=8, corrupt=0.2, siblings=1, seed=7), LookupDrafter()]):
        spec = speculating(engine, drafters)  # type: ignore[arg-type]
        for prompt, params in cases:
            assert spec.complete(prompt, params).token_ids == outputs[tuple(prompt)]


def test_engine_spec_modes(engine: Engine) -> None:
    """Engine.from_pretrained(spec=...) on a MoE checkpoint: lookup, MTP and auto equal plain."""
    prompt = _prompts(engine.vocab_size, 3, 1)[0] * 2
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = engine.complete(prompt, params).token_ids
    assert engine.model.path is not None
    for mode in ("lookup", "mtp", "auto"):
        e = Engine.from_pretrained(engine.model.path, spec=mode)
        assert e.complete(prompt, params).token_ids == ref
