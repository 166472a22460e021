"""The Engine on tiny random checkpoints: prompts (ids, text, chat), stops, limits, seeds, streaming, constraints.

Source: tandem/engine.py. The model is random, so each test first finds what it generates and then checks the
engine's handling of it (where generation stops, which text comes out) against that.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem.models.protocol import Capabilities
from tandem.engine import Engine, PromptTooLongError
from tandem.sampling import PenaltyState, SamplingParams, choose_token
from tandem.tokenizer import Tokenizer
from tools.make_checkpoint import write_checkpoint
from tools.make_tokenizer import train_tokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. A model reads tokens and writes text; the engine streams "
        "it back. Hello world, hello engine! Numbers 0 1 2 3 4 5 6 7 8 9 and more words: state, decode, prefill.\n")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose vocab_size equals its trained tokenizer's; eos = <|im_end|>."""
    root = tmp_path_factory.mktemp("engine_ckpt")
    train_tokenizer([TEXT] * 20, 400, root)
    tok = Tokenizer.from_dir(root)
    assert tok is not None
    write_checkpoint(root, vocab_size=tok.vocab_size, init_std=0.1, seed=5, with_vision=False, with_mtp=False,
                     num_shards=1)
    gen = json.loads((root / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id]
    (root / "generation_config.json").write_text(json.dumps(gen))
    return root


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Engine:
    return Engine.from_pretrained(ckpt, max_context=256)


def _greedy(engine: Engine, prompt: list[int], n: int = 40) -> tuple[list[int], list[str]]:
    chunks = list(engine.generate(prompt, SamplingParams(max_tokens=n, **GREEDY)))  # type: ignore[arg-type]
    return [c.token_ids[0] for c in chunks], [c.text for c in chunks]


def test_checkpoint_without_tokenizer_takes_ids(tiny_ckpt: Path) -> None:
    engine = Engine.from_pretrained(tiny_ckpt)
    assert engine.tokenizer is None and engine.chat_template is None
    assert engine.eos_token_ids == [510, 511] and engine.vocab_size == 512
    done = engine.complete([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))  # type: ignore[arg-type]
    assert done.prompt_ids == [1, 2, 3] and len(done.token_ids) == 4 and done.text == ""
    assert done.finish_reason == "length" and done.prefill_s >= 0 and done.decode_s >= 0
    with pytest.raises(ValueError, match="no tokenizer.json; send token ids"):
        engine.complete("hello")
    with pytest.raises(ValueError, match="no chat template"):
        engine.complete([{"role": "user", "content": "hi"}])


def test_vocab_sizes_match(engine: Engine) -> None:
    assert engine.tokenizer is not None and engine.tokenizer.vocab_size == engine.vocab_size
    assert engine.eos_token_ids == [engine.tokenizer.eos_token_id]


def test_text_prompt(engine: Engine) -> None:
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode("Hello world, the engine")
    done = engine.complete("Hello world, the engine", SamplingParams(max_tokens=8, **GREEDY))  # type: ignore[arg-type]
    assert done.prompt_ids == ids
    assert done.token_ids == engine.complete(ids, SamplingParams(max_tokens=8, **GREEDY)).token_ids  # type: ignore[arg-type]
    assert done.text == engine.tokenizer.decode(done.token_ids)


def test_chat_messages_use_the_template(engine: Engine) -> None:
    assert engine.tokenizer is not None and engine.chat_template is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello engine"}]
    rendered = engine.chat_template.render(messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello engine")
    assert rendered.endswith("<|im_start|>assistant\n<think>\n")
    ids = engine.encode_prompt(messages)
    assert ids == engine.tokenizer.encode(rendered)
    assert ids[0] == engine.tokenizer.encode("<|im_start|>")[0]  # a special token is one id
    done = engine.complete(messages, SamplingParams(max_tokens=3, **GREEDY))  # type: ignore[arg-type]
    assert done.prompt_ids == ids and len(done.token_ids) == 3
    no_think = engine.encode_prompt(messages, chat_template_kwargs={"enable_thinking": False})
    assert engine.tokenizer.decode(no_think).endswith("<think>\n\n</think>\n\n")


def test_max_tokens_gives_length(engine: Engine) -> None:
    for n in (1, 2, 7):
        done = engine.complete([5, 6, 7], SamplingParams(max_tokens=n, **GREEDY))  # type: ignore[arg-type]
        assert len(done.token_ids) == n and done.finish_reason == "length"


def test_eos_stops_and_its_text_is_dropped(engine: Engine) -> None:
    assert engine.tokenizer is not None
    prompt = [10, 20, 30]
    ids, _ = _greedy(engine, prompt)
    k = next(i for i in range(2, len(ids)) if engine.tokenizer.decode([ids[i]]) and ids[i] not in ids[:i])
    eos = ids[k]
    with_eos = Engine(engine.model, engine.tokenizer, engine.chat_template, 256, [eos])
    done = with_eos.complete(prompt, SamplingParams(temperature=0.0, max_tokens=40))
    assert done.finish_reason == "stop" and done.token_ids == ids[:k + 1]
    assert done.text == engine.tokenizer.decode(ids[:k])
    # ignore_eos runs on to max_tokens; stop_token_ids overrides the default eos ids
    assert with_eos.complete(prompt, SamplingParams(max_tokens=40, **GREEDY)).token_ids == ids  # type: ignore[arg-type]
    done = engine.complete(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[eos]))
    assert done.finish_reason == "stop" and done.token_ids == ids[:k + 1]


def test_stop_strings(engine: Engine) -> None:
    prompt = [3, 1, 4, 1, 5]
    ids, pieces = _greedy(engine, prompt, 40)
    full = "".join(pieces)
    # a stop string made of the end of one token's text and the start of the next's, first seen at that boundary
    chosen = None
    for i in range(len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 1 and len(b) >= 1:
            stop = a[-2:] + b[:2]
            at = len("".join(pieces[:i + 1])) - len(a[-2:])
            if full.find(stop) == at and at > 0:
                chosen = (stop, at, i + 1)
                break
    assert chosen is not None, pieces
    stop, at, token_index = chosen
    done = engine.complete(prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))  # type: ignore[arg-type]
    assert done.finish_reason == "stop" and done.text == full[:at] and stop not in done.text
    assert done.token_ids == ids[:token_index + 1]
    streamed = list(engine.generate(prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY)))  # type: ignore[arg-type]
    assert "".join(c.text for c in streamed) == full[:at]
    assert all(stop not in "".join(c.text for c in streamed[:j + 1]) for j in range(len(streamed)))
    # a stop string that never appears changes nothing
    done = engine.complete(prompt, SamplingParams(max_tokens=40, stop=["\x00never"], **GREEDY))  # type: ignore[arg-type]
    assert done.text == full and done.finish_reason == "length"


def test_max_context_above_the_checkpoint_is_a_warning(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    limit = json.loads((ckpt / "config.json").read_text())
    limit = limit.get("text_config", limit)["max_position_embeddings"]
    with caplog.at_level("WARNING", logger="tandem"):
        engine = Engine.from_pretrained(ckpt, max_context=limit + 1000)
    assert engine.max_context == limit
    assert [r.getMessage() for r in caplog.records if r.name == "tandem"] == [
        f"max_context {limit + 1000} is above this checkpoint's max_position_embeddings {limit}: the context holds "
        f"{limit} tokens"]


def test_prompt_too_long(ckpt: Path) -> None:
    engine = Engine.from_pretrained(ckpt, max_context=16)
    assert engine.max_context == 16
    with pytest.raises(PromptTooLongError, match="the prompt has 16 tokens; the context holds 16"):
        engine.complete(list(range(1, 17)))
    done = engine.complete(list(range(1, 15)), SamplingParams(max_tokens=10, **GREEDY))  # type: ignore[arg-type]
    assert len(done.token_ids) == 2 and done.finish_reason == "length"  # the context, not max_tokens, ends it


def test_out_of_vocabulary_prompt(engine: Engine) -> None:
    with pytest.raises(ValueError, match=f"prompt token id {engine.vocab_size} is outside the vocabulary"):
        engine.complete([1, engine.vocab_size])
    with pytest.raises(ValueError, match="prompt token id -1 is outside"):
        engine.complete([-1])
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.complete([])


def test_seeds(engine: Engine) -> None:
    def sample(seed: int) -> tuple[list[int], str]:
        done = engine.complete([7, 8, 9], SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True))
        return done.token_ids, done.text
    a, b, c = sample(1), sample(1), sample(2)
    assert a == b and a[1] == b[1]
    assert a[0] != c[0] and a[1] != c[1]
    greedy = engine.complete([7, 8, 9], SamplingParams(max_tokens=24, **GREEDY)).token_ids  # type: ignore[arg-type]
    assert a[0] != greedy


def test_generate_streams_what_complete_returns(engine: Engine) -> None:
    for params in (SamplingParams(max_tokens=30, **GREEDY),  # type: ignore[arg-type]
                   SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30),
                   SamplingParams(max_tokens=30, stop=["e"], **GREEDY)):  # type: ignore[arg-type]
        done = engine.complete("the engine streams", params)
        chunks = list(engine.generate("the engine streams", params))
        assert "".join(c.text for c in chunks) == done.text
        assert [t for c in chunks for t in c.token_ids] == done.token_ids
        assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason == done.finish_reason


def test_logprobs(engine: Engine) -> None:
    done = engine.complete([1, 2], SamplingParams(max_tokens=3, logprobs=2, **GREEDY))  # type: ignore[arg-type]
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    for lp in done.logprobs:
        assert lp.top[0][0] == lp.token_id and lp.logprob == lp.top[0][1] <= 0.0 and len(lp.top) == 2


class _EvenOnly:
    """Allows only even ids, and at every third position only ids below 100; records what it saw."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.seen: list[int] = []

    def allowed(self) -> np.ndarray:
        mask = np.arange(self.vocab) % 2 == 0
        if len(self.seen) % 3 == 2:
            mask &= np.arange(self.vocab) < 100
        return mask

    def advance(self, token_id: int) -> None:
        assert bool(self.allowed()[token_id]), f"masked token {token_id} drawn at {len(self.seen)}"
        self.seen.append(token_id)


def test_constraint_never_lets_a_masked_token_through(engine: Engine) -> None:
    unconstrained = engine.complete([11, 12], SamplingParams(max_tokens=30, **GREEDY)).token_ids  # type: ignore[arg-type]
    assert any(t % 2 for t in unconstrained)  # the mask has work to do
    for params in (SamplingParams(max_tokens=30, **GREEDY),  # type: ignore[arg-type]
                   SamplingParams(temperature=1.5, seed=9, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_k=5, seed=1, max_tokens=30, ignore_eos=True)):
        c = _EvenOnly(engine.vocab_size)
        chunks = list(engine.generate([11, 12], params, constraint=c))
        out = [t for ch in chunks for t in ch.token_ids]
        assert out == c.seen and len(out) == 30
        assert all(t % 2 == 0 for t in out)
        assert all(out[i] < 100 for i in range(2, 30, 3))
        c2 = _EvenOnly(engine.vocab_size)
        assert engine.complete([11, 12], params, constraint=c2).token_ids == out


class _Logits:
    """Host logits dressed as device logits (not an ndarray): the engine takes its device paths."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def get(self) -> np.ndarray:  # as cupy's device-to-host copy
        return self.values


class _Pending:
    def __init__(self, token: int) -> None:
        self.token, self.reads = token, 0

    def get(self) -> int:
        self.reads += 1
        return self.token


def _host_choose(logits: _Logits, params: SamplingParams | None, seed: int, position: int) -> int:
    if params is None or params.greedy:
        return int(np.argmax(logits.values))
    return choose_token(logits.values, params, None, seed, position)


class _AheadModel:
    """The CPU model with the device model's run-ahead verbs (``choose_on_device``, ``decode`` of a pending id;
    the choice is choose_token's, as the device's up to float rounding), counting the decode steps queued and the
    ids read, so the engine's ``_run_ahead`` loop runs in CI."""

    capabilities = Capabilities(device_sampling=True)

    def __init__(self, host: object) -> None:
        self.host, self.hp = host, host.hp  # type: ignore[attr-defined]
        self.decodes = self.chosen = 0
        self.queued_unread = 0  # decodes queued from an id the host had not read yet
        self.no_token_at = -1  # a choice at this position returns -1 (the sampler found no candidate)
        self.pen_state: PenaltyState | None = None  # the device's penalty counts, per sequence
        self.pen_seq: object = None
        self.last: int | None = None

    def new_state(self, max_len: int) -> object:
        return self.host.new_state(max_len)  # type: ignore[attr-defined]

    def prefill(self, state: object, ids: list[int]) -> _Logits:
        return _Logits(self.host.prefill(state, ids))  # type: ignore[attr-defined]

    def choose_on_device(self, state: object, logits: _Logits, params: SamplingParams | None = None, seed: int = 0,
                         position: int = 0, penalties: PenaltyState | None = None) -> _Pending:
        """As the device: penalties' counts are copied at a sequence's first choice, then each choice counts the
        id chosen before it (the engine no longer updates the host state)."""
        self.chosen += 1
        assert position == state.length  # type: ignore[attr-defined]
        if penalties is not None:
            if self.pen_state is None or self.pen_seq is not state:
                self.pen_state, self.pen_seq = penalties.copy(), state
            elif self.last is not None:
                self.pen_state.add(self.last)
            assert penalties.output_counts.sum() == 0  # the engine left its state alone
            x = self.pen_state.apply(logits.values)
            token = int(np.argmax(x)) if params is None or params.greedy else choose_token(
                logits.values, params, self.pen_state, seed, position)
        else:
            token = _host_choose(logits, params, seed, position)
        self.last = token
        return _Pending(-1 if position == self.no_token_at else token)

    def decode(self, state: object, token: _Pending | int) -> _Logits:
        self.decodes += 1
        if isinstance(token, _Pending):
            self.queued_unread += token.reads == 0
            token = max(token.token, 0)  # the device embeds row 0 for a -1
        return _Logits(self.host.decode(state, token))  # type: ignore[attr-defined]


def test_run_ahead_loop_gives_the_plain_loop_tokens(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine._run_ahead (plain rounds on a device model, each step queued before its id is read) stops exactly
    where the plain loop stops: budget, eos, stop strings, greedy and sampled; at most one step past the last
    token, never past the budget; penalties counted on the device; a -1 id (no token left) raises as choose_token
    does. Logprobs and ``run_ahead = False`` keep the plain loop (tests/test_cuda_engine.py: the same on the GPU)."""
    assert engine.tokenizer is not None
    model = _AheadModel(engine.model)
    prompt = [3, 1, 4, 1, 5]
    ids, pieces = _greedy(engine, prompt, 40)
    eos = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i] and engine.tokenizer.decode([t]))
    k = ids.index(eos)
    ahead = Engine(model, engine.tokenizer, engine.chat_template, 256, [eos])
    plain = Engine(engine.model, engine.tokenizer, engine.chat_template, 256, [eos])
    stop = "".join(pieces[5:7])[-3:]
    cases = [SamplingParams(max_tokens=n, **GREEDY) for n in (1, 2, 40)] + [  # type: ignore[arg-type]
        SamplingParams(temperature=0.0, max_tokens=40),  # eos at k
        SamplingParams(max_tokens=40, stop=[stop], **GREEDY),  # type: ignore[arg-type]
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=8, max_tokens=30),
        SamplingParams(max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5, **GREEDY),  # type: ignore[arg-type]
        SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.7, seed=2, max_tokens=30, ignore_eos=True)]
    for params in cases:
        model.decodes = model.queued_unread = 0
        want = plain.complete(prompt, params)
        got = ahead.complete(prompt, params)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        n = len(got.token_ids)
        assert model.decodes == min(n, params.max_tokens - 1) and model.queued_unread == model.decodes
        assert len(ahead.last_stats.rounds) == n - 1
    assert ahead.complete(prompt, SamplingParams(temperature=0.0, max_tokens=40)).token_ids == ids[:k + 1]
    model.no_token_at = len(prompt) + 3
    with pytest.raises(ValueError, match="every token is masked"):
        ahead.complete(prompt, SamplingParams(max_tokens=10, **GREEDY))  # type: ignore[arg-type]
    model.no_token_at = -1
    monkeypatch.setattr("tandem.choose.device_choose", _host_choose)
    for params in (SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=1),
                   SamplingParams(max_tokens=12, logprobs=2, **GREEDY)):  # type: ignore[arg-type]
        model.chosen = 0
        got, want = ahead.complete(prompt, params), plain.complete(prompt, params)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and model.chosen == 0
    ahead.run_ahead = False
    assert ahead.complete(prompt, SamplingParams(max_tokens=9, **GREEDY)).token_ids == ids[:9]  # type: ignore[arg-type]
    assert model.chosen == 0
