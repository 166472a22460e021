"""Tokenizer wrapper and incremental detokenization (byte-level BPE and byte-fallback BPE)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tandem.tokenizer import IncrementalDetokenizer, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ("Hello world! Café, naïve, déjà vu, Ærøskøbing, straße. 日本語のテキストと中文字符。 "
          "Emoji: 😀🎉👍🏽 🇫🇷 — ‘quotes’ … 1234 + 5678 = 6912.\nNew line\tTab. ")
ALPHABET = list("abcdeéèüßøÆ 日本語中文字😀🎉👍🏽🇫🇷—…\n€🙂") + ["<|im_start|>", "<think>"]


def load_make_tokenizer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tokenizer", ROOT / "tools" / "make_tokenizer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bytelevel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bytelevel")
    return Path(load_make_tokenizer().train_tokenizer([SAMPLE] * 30, 420, out))


@pytest.fixture(scope="module")
def bytelevel(bytelevel_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(bytelevel_dir)
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def fallback() -> Tokenizer:
    """SentencePiece-style BPE: ▁ for spaces, a small alphabet, and <0xXX> byte-fallback tokens."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    inner = HFTokenizer(models.BPE(byte_fallback=True))
    inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=byte_tokens, limit_alphabet=40,
                                  show_progress=False)
    inner.train_from_iterator([SAMPLE] * 30, trainer)
    return Tokenizer(inner, {})


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


def test_from_dir_without_tokenizer_json(tmp_path: Path) -> None:
    assert Tokenizer.from_dir(tmp_path) is None


def test_special_tokens_and_config(bytelevel: Tokenizer) -> None:
    assert bytelevel.eos_token == "<|im_end|>" and bytelevel.pad_token == "<|endoftext|>"
    assert bytelevel.bos_token is None and bytelevel.bos_token_id is None
    assert bytelevel.eos_token_id == bytelevel.token_id("<|im_end|>") is not None
    ids = bytelevel.encode("<|im_start|>user\nHi<|im_end|>\n<think>\n")
    assert ids[0] == bytelevel.token_id("<|im_start|>")
    assert bytelevel.token_id("<|im_end|>") in ids and bytelevel.token_id("<think>") in ids
    assert bytelevel.token_id("not a token at all") is None
    assert bytelevel.vocab_size >= 256 + 9


def test_encode_decode_roundtrip(bytelevel: Tokenizer, fallback: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(50):
        text = random_text(rng, 40)
        assert bytelevel.decode(bytelevel.encode(text)) == text
    assert fallback.decode(fallback.encode("naïve 😀 日本")) == "naïve 😀 日本"
    # a character absent from the training text can only be spelled by byte-fallback tokens
    assert [fallback.id_to_token(i) for i in fallback.encode("🙂")][-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]


def test_decode_rejects_negative_ids(bytelevel: Tokenizer) -> None:
    with pytest.raises(ValueError, match="negative"):
        bytelevel.decode([1, -1])


@pytest.mark.parametrize("which", ["bytelevel", "fallback"])
def test_incremental_matches_full_decode_on_text(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng, rng.randint(1, 30))
        ids = tok.encode(text)
        pieces = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("which", ["bytelevel", "fallback"])
def test_incremental_matches_full_decode_on_random_ids(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    rng = random.Random(2)
    split_char = 0
    for _ in range(500):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        full = tok.decode(ids)
        pieces = stream(tok, ids)
        if "\ufffd" not in full:
            assert "".join(pieces) == full
            assert not any("\ufffd" in p for p in pieces)
        elif which == "bytelevel":  # lossy per byte, so prefix-stable even on invalid UTF-8
            assert "".join(pieces) == full
        split_char += sum(1 for p in pieces[:-1] if p == "")
    assert split_char > 0  # some pushes really were held back


def test_held_back_until_character_completes(fallback: Tokenizer) -> None:
    ids = [fallback.token_id(f"<0x{b:02X}>") for b in "€".encode()]
    assert all(i is not None for i in ids)
    detok = IncrementalDetokenizer(fallback)
    assert [detok.push(i) for i in ids if i is not None] == ["", "", "€"]
    assert detok.flush() == ""
    detok2 = fallback.detokenizer()
    assert detok2.push(ids[0] or 0) == ""
    assert detok2.flush() == "\ufffd"  # an incomplete character at the end comes out lossy
