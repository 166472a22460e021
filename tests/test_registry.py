"""The registry serves a made-up architecture (tests/toy_arch.py) with no edit outside its file (DESIGN.md layer 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tandem.config import ConfigError, read_config
from tandem.engine import Engine
from tandem.models import registry
from tandem.sampling import SamplingParams

TOY = "tests.toy_arch:ToyModel"


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register ToyForCausalLM for one test; the registry is restored afterwards."""
    monkeypatch.setattr(registry, "_ADAPTERS", dict(registry._ADAPTERS))
    registry.register(["ToyForCausalLM"], TOY)


def _toy_ckpt(path: Path, step: int = 3, vocab: int = 50, eos: list[int] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["ToyForCausalLM"], "model_type": "toy", "vocab_size": vocab,
           "max_position_embeddings": 64, "eos_token_ids": eos or []}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "toy_weights.json").write_text(json.dumps({"step": step}))
    return path


def test_unregistered_toy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config declares ToyForCausalLM, toy"):
        registry.resolve(read_config(_toy_ckpt(tmp_path)))


def test_registration_is_lazy(toy_registered: None, tmp_path: Path) -> None:
    sys.modules.pop("tests.toy_arch", None)
    assert "ToyForCausalLM" in registry.registered()
    assert "tests.toy_arch" not in sys.modules  # registering imports nothing
    cls = registry.resolve(read_config(_toy_ckpt(tmp_path)))
    assert cls.__name__ == "ToyModel" and "tests.toy_arch" in sys.modules


def test_toy_serves_a_request(toy_registered: None, tmp_path: Path) -> None:
    engine = Engine.from_pretrained(_toy_ckpt(tmp_path, step=3, vocab=50))
    assert type(engine.model).__name__ == "ToyModel"
    assert engine.tokenizer is None and engine.chat_template is None and engine.vocab_size == 50
    assert engine.max_context == 64
    done = engine.complete([1, 2, 5], SamplingParams(temperature=0.0, max_tokens=6))
    assert done.prompt_ids == [1, 2, 5]
    assert done.token_ids == [8, 11, 14, 17, 20, 23]
    assert done.finish_reason == "length" and done.text == ""
    assert engine.model.decode_calls == 5  # the last token is not fed back


def test_toy_eos_and_sampling(toy_registered: None, tmp_path: Path) -> None:
    engine = Engine.from_pretrained(_toy_ckpt(tmp_path, step=7, vocab=50, eos=[22]))
    done = engine.complete([1], SamplingParams(temperature=0.0, max_tokens=10))
    assert done.token_ids == [8, 15, 22] and done.finish_reason == "stop"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.complete([50])
    # The toy's logits are 1 on one id and 0 elsewhere: a seeded sample is reproducible.
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    assert engine.complete([1], params).token_ids == engine.complete([1], params).token_ids
