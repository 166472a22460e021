"""Speculative output equals plain output token for token (issue 5, "Exactness" and "Sampling").

Greedy: 50 prompts x 128 tokens on a random checkpoint for every drafter (lookup, MTP, an oracle that is always
right, garbage that is never right, noisy oracle trees with garbage siblings, random chain/bush/mixed shapes),
plus max-token and stop-token limits that fall mid-path and stop strings. Sampled: 50 prompts at temperatures
0.7 and 1.0 with top-p and penalties, seeded. The embedded model is used too when it is present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spec_helpers import GarbageDrafter, OracleDrafter, speculating
from tandem.engine import DEFAULT_MODEL, Engine
from tandem.sampling import SamplingParams
from tandem.speculative.lookup import LookupDrafter
from tandem.speculative.mtp_drafter import MTPDrafter
from tandem.speculative.speculator import default_mode
from tools.make_checkpoint import write_checkpoint

NUM_PROMPTS, NEW_TOKENS = 50, 128


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    # two layers (one GDN, one attention) keep 50 prompts x 128 tokens per drafter quick
    path = write_checkpoint(tmp_path_factory.mktemp("spec"), num_hidden_layers=2, full_attention_interval=2,
                            init_std=0.1, seed=9, num_shards=1)
    return Engine.from_pretrained(path)


def make_prompts(vocab: int, seed: int, num: int = NUM_PROMPTS) -> list[list[int]]:
    """Random prompts, half of them with repeated spans (so lookup finds matches)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        ids = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
        out.append(ids * 3 if i % 2 else ids)
    return out


@pytest.fixture(scope="module")
def greedy(engine: Engine) -> dict[tuple[int, ...], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return {tuple(p): engine.complete(p, params).token_ids for p in make_prompts(engine.vocab_size, 1)}


def drafters_for(name: str, engine: Engine, outputs: dict[tuple[int, ...], list[int]]) -> list[Any]:
    v = engine.vocab_size
    return {
        "lookup": lambda: [LookupDrafter()],
        "mtp": lambda: [MTPDrafter(engine.model.draft_heads(), steps=3, max_branch=2)],
        "oracle": lambda: [OracleDrafter(outputs, v, depth=12)],
        "garbage_chain": lambda: [GarbageDrafter(v, 3, "chain")],
        "garbage_bush": lambda: [GarbageDrafter(v, 3, "bush", seed=1)],
        "noisy_tree": lambda: [OracleDrafter(outputs, v, depth=10, corrupt=0.15, siblings=1, seed=2),
                               GarbageDrafter(v, 4, "mixed", seed=3)],
        "lookup_mtp_oracle": lambda: [LookupDrafter(), MTPDrafter(engine.model.draft_heads(), steps=3),
                                      OracleDrafter(outputs, v, depth=6, corrupt=0.3, seed=4)],
    }[name]()


@pytest.mark.parametrize("name", ["lookup", "mtp", "oracle", "garbage_chain", "garbage_bush", "noisy_tree",
                                  "lookup_mtp_oracle"])
def test_greedy_spec_equals_plain(engine: Engine, greedy: dict[tuple[int, ...], list[int]], name: str) -> None:
    spec = speculating(engine, drafters_for(name, engine, greedy), max_nodes=24)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = rounds = 0
    for prompt, ref in greedy.items():
        done = spec.complete(list(prompt), params)
        assert done.token_ids == ref, f"{name}: differs at {next(i for i, (a, b) in enumerate(zip(done.token_ids, ref)) if a != b)}"
        assert done.finish_reason == "length"
        assert done.stats is not None
        tokens += sum(r.num_tokens for r in done.stats.rounds)
        rounds += done.stats.num_rounds
    per_round = tokens / rounds
    print(f"\n[{name}] {tokens / rounds:.2f} tokens per round")
    if name == "oracle":  # accepts everything: every round commits its whole chain (12) plus the bonus
        assert per_round > 10
    if name.startswith("garbage"):
        assert per_round < 1.1


def test_limits_mid_path(engine: Engine, greedy: dict[tuple[int, ...], list[int]]) -> None:
    """max_tokens and stop ids that fall inside an accepted path end generation exactly where plain does."""
    rng = np.random.default_rng(5)
    spec = speculating(engine, [OracleDrafter(greedy, engine.vocab_size, depth=16)])
    for prompt, ref in list(greedy.items())[:25]:
        n = int(rng.integers(1, 60))
        for params in (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[ref[n]])):
            plain = engine.complete(list(prompt), params)
            got = spec.complete(list(prompt), params)
            assert (got.token_ids, got.finish_reason) == (plain.token_ids, plain.finish_reason)
            assert plain.finish_reason == ("length" if params.stop_token_ids is None else "stop")


class CharTokenizer:
    """A fake tokenizer: token t detokenizes to a letter (so stop strings can fall inside a path)."""

    def detokenizer(self) -> Any:
        class Detok:
            def push(self, t: int) -> str:
                return chr(ord("a") + t % 7)

            def flush(self) -> str:
                return ""
        return Detok()


def test_stop_strings_mid_path(engine: Engine, greedy: dict[tuple[int, ...], list[int]]) -> None:
    plain = Engine(engine.model, CharTokenizer(), None, engine.max_context)  # type: ignore[arg-type]
    spec = speculating(plain, [OracleDrafter(greedy, engine.vocab_size, depth=16)])
    rng = np.random.default_rng(6)
    hits = 0
    for prompt, ref in list(greedy.items())[:25]:
        text = "".join(chr(ord("a") + t % 7) for t in ref)
        at = int(rng.integers(5, 100))
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=[text[at:at + 3]])
        a, b = plain.complete(list(prompt), params), spec.complete(list(prompt), params)
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        hits += a.finish_reason == "stop"
    assert hits >= 20


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_spec_equals_plain(engine: Engine, temperature: float) -> None:
    """Seeded sampling with top-p and penalties: oracle (all accepted), noisy trees and lookup give plain's tokens."""
    outputs: dict[tuple[int, ...], list[int]] = {}
    cases = []
    for i, prompt in enumerate(make_prompts(engine.vocab_size, 2)):
        params = SamplingParams(temperature=temperature, top_p=0.9, top_k=0 if i % 2 else 50,
                                repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2, seed=i,
                                max_tokens=64, ignore_eos=True)
        outputs[tuple(prompt)] = engine.complete(prompt, params).token_ids
        cases.append((prompt, params))
    v = engine.vocab_size
    for drafters in ([OracleDrafter(outputs, v, depth=12)],
                     [OracleDrafter(outputs, v, depth=8, corrupt=0.2, siblings=1, seed=7), LookupDrafter()]):
        spec = speculating(engine, drafters)  # type: ignore[arg-type]
        for prompt, params in cases:
            assert spec.complete(prompt, params).token_ids == outputs[tuple(prompt)]


def test_engine_spec_modes(engine: Engine) -> None:
    """The public option: Engine.from_pretrained(spec=...) with StairCut, and last_stats."""
    prompt = make_prompts(engine.vocab_size, 3, 1)[0] * 2
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = engine.complete(prompt, params).token_ids
    assert engine.model.path is not None
    for mode in ("lookup", "mtp", "auto"):
        e = Engine.from_pretrained(engine.model.path, spec=mode)
        chunks = list(e.generate(prompt, params))
        assert [t for c in chunks for t in c.token_ids] == ref
        assert e.last_stats.num_rounds == len(chunks) - 1
    with pytest.raises(ValueError):
        Engine.from_pretrained(engine.model.path, spec="bogus")


@pytest.mark.slow  # 12 prompts x 128 tokens x 3 engines on the embedded model: a minute on a CPU
@pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(), reason="embedded model not present")
def test_embedded_model_greedy_and_sampled() -> None:
    plain = Engine.from_pretrained(DEFAULT_MODEL)
    spec = Engine.from_pretrained(DEFAULT_MODEL, spec="auto")
    spec_lookup = speculating(plain, [LookupDrafter()], policy="all")
    texts = ["def fibonacci(n):\n    ", "The quick brown fox jumps over the lazy dog. The quick brown",
             "import numpy as np\nimport numpy as np\n", "class Stack:\n    def push(self, x):\n"]
    for i in range(12):  # every (text, repeats, greedy or sampled, penalty) combination of the 12 once
        prompt = texts[i % len(texts)] * (1 + i % 3)
        params = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, top_p=0.95, seed=i, max_tokens=128,
                                repetition_penalty=1.0 if i % 4 < 2 else 1.1)
        ref = plain.complete(prompt, params)
        for e in (spec, spec_lookup):
            got = e.complete(prompt, params)
            assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


def test_readme_path(tmp_path: Path) -> None:
    """A checkpoint without an MTP layer: --spec mtp refuses, auto falls back to lookup."""
    path = write_checkpoint(tmp_path / "nomtp", with_mtp=False, num_shards=1)
    with pytest.raises(ValueError, match="MTP"):
        Engine.from_pretrained(path, spec="mtp")
    e = Engine.from_pretrained(path, spec="auto")
    assert e.speculator is not None and [d.name for d in e.speculator.drafters] == ["lookup"]
    e = Engine.from_pretrained(path, spec="default", device="cpu", cache="off")  # what tandem serve runs on a CPU
    assert e.speculator is not None and [d.name for d in e.speculator.drafters] == ["lookup"]
    assert default_mode("cuda") == "off"


class _Rows:
    """Host logits dressed as device logits (not an ndarray; rows by index, ``get()`` copies to the host)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.shape = values.shape

    def __getitem__(self, i: Any) -> "_Rows":
        return _Rows(self.values[i])

    def get(self) -> np.ndarray:
        return self.values.copy()


class _DeviceLike:
    """The host model with device-like logits, so the engine takes its device routes (``choose.device_choose`` and the
    accept walk's ``choose.device_choose_rows``); everything else is the host model's."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)

    def prefill(self, *args: Any, **kwargs: Any) -> _Rows:
        return _Rows(self.host.prefill(*args, **kwargs))

    def decode(self, *args: Any, **kwargs: Any) -> _Rows:
        return _Rows(self.host.decode(*args, **kwargs))

    def verify_tree(self, *args: Any, **kwargs: Any) -> _Rows:
        return _Rows(self.host.verify_tree(*args, **kwargs))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=40,
                                                   ignore_eos=True)], ids=["greedy", "sampled"])
def test_device_rows_walk_takes_every_choice_at_once(engine: Engine, greedy: dict[tuple[int, ...], list[int]],
                                                     params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device model the accept walk takes its ids from one choice of every verified row
    (``choose.device_choose_rows``, one launch) at the rows' absolute positions: the same output as plain rounds."""
    import tandem.choose as choose_mod
    from tandem.sampling import choose_token

    batches: list[int] = []

    def one(row: _Rows, p: SamplingParams, seed: int, position: int) -> int:
        return choose_token(row.values, p, None, seed, position)

    def rows(logits: _Rows, p: SamplingParams, seed: int, positions: list[int]) -> list[int]:
        assert logits.shape[0] == len(positions) > 1
        batches.append(len(positions))
        return [one(logits[i], p, seed, q) for i, q in enumerate(positions)]

    monkeypatch.setattr(choose_mod, "device_choose", one)
    monkeypatch.setattr(choose_mod, "device_choose_rows", rows)
    device = Engine(_DeviceLike(engine.model), None, None, engine.max_context)
    spec = speculating(device, [OracleDrafter(greedy, engine.vocab_size, depth=6, corrupt=0.3, siblings=1),
                                GarbageDrafter(engine.vocab_size, 3, "mixed", seed=1)], max_nodes=12)
    for p in make_prompts(engine.vocab_size, 1, 8):
        want = engine.complete(p, params).token_ids
        assert device.complete(p, params).token_ids == want
        if params.greedy:  # the oracle proposes the greedy continuation
            assert spec.complete(p, params).token_ids == want
        else:
            lookup = speculating(device, [LookupDrafter(), GarbageDrafter(engine.vocab_size, 3, "bush", seed=2)],
                                 max_nodes=8)
            assert lookup.complete(p, params).token_ids == want
    assert batches, "no tree was verified"
