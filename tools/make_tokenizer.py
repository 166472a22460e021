"""Train a small Qwen3.5-style tokenizer: byte-level BPE with the Qwen3.5 special tokens and chat template.

Used by the tests and by the training of the default model. The layout follows the Qwen tokenizers
(spec/qwen3_5.md §11.1): a regex split then a byte-level alphabet (every byte is a token, so no text is ever
unknown), the ChatML/think/tool special tokens as added tokens matched whole in text, eos `<|im_end|>`,
pad `<|endoftext|>`, no bos. `byte_fallback` is set on the BPE model as a guard; with the full byte alphabet in
the vocabulary it never triggers.

Usage: python tools/make_tokenizer.py OUT_DIR VOCAB_SIZE TEXT_FILE [TEXT_FILE ...]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATE_PATH = Path(__file__).resolve().parent / "qwen3_5_chat_template.jinja"

# Special (control) tokens: skipped by decode(skip_special_tokens=True).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens the model writes as text (kept by skip_special_tokens), as in the Qwen tokenizers.
TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen2-family pre-tokenizer split: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs, newlines, spaces.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def chat_template_text() -> str:
    """Tandem's Qwen3.5-style chat template (tools/qwen3_5_chat_template.jinja)."""
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a byte-level BPE on `texts` and write tokenizer.json + tokenizer_config.json to `out_dir`.

    Args:
        texts: training text, any number of documents.
        vocab_size: target vocabulary size including the 256 byte tokens and the 9 added tokens (>= 266).
        out_dir: created if missing.
    Returns:
        out_dir as a Path.
    Raises:
        ValueError: vocab_size too small to hold the byte alphabet and the added tokens.
    """
    num_added = len(SPECIAL_TOKENS) + len(TEXT_TOKENS)
    if vocab_size < 256 + num_added + 1:
        raise ValueError(f"vocab_size must be >= {256 + num_added + 1}, got {vocab_size}")
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added, special_tokens=[], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer)
    # Added after training so they get the ids right after the learned vocabulary, as in Qwen (ids 248044+).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 262144,
        "chat_template": chat_template_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                encoding="utf-8")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, vocab_size, files = argv[0], int(argv[1]), argv[2:]
    texts = (Path(f).read_text(encoding="utf-8") for f in files)
    print(train_tokenizer(texts, vocab_size, out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
