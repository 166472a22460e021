"""Tokenizer: a typed wrapper over a checkpoint's `tokenizer.json`, and incremental detokenization.

Source: the checkpoint's `tokenizer.json` (HF `tokenizers` format) and `tokenizer_config.json` (special-token
strings). Qwen3.5 facts (ids, eos/pad/bos strings) are in spec/qwen3_5.md §11.1. A checkpoint without
`tokenizer.json` still loads: `Tokenizer.from_dir` returns None and requests carry token ids.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

# `tokenizers.Tokenizer.encode` holds the GIL for the whole text (seconds for megabytes: every other thread,
# a server's event loop included, stops); `encode_batch` gives the same ids and releases it. Texts past this
# length take the second path.
_GIL_FREE_CHARS = 16384
REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode writes for an incomplete or invalid byte sequence


def _token_string(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, an AddedToken dict ({"content": ...}) or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def read_tokenizer_config(root: Path) -> dict[str, Any]:
    """``<root>/tokenizer_config.json`` as a dict ({} when absent).

    Raises: ValueError when the file is not JSON or not a JSON object.
    """
    cfg_file = root / "tokenizer_config.json"
    if not cfg_file.is_file():
        return {}
    try:
        loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"cannot parse {cfg_file}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


class Tokenizer:
    """Text <-> token ids for one checkpoint.

    Args:
        inner: a loaded `tokenizers.Tokenizer`.
        config: the parsed `tokenizer_config.json` ({} when absent); special-token strings are read from it.
    """

    def __init__(self, inner: tokenizers.Tokenizer, config: dict[str, Any] | None = None) -> None:
        self._inner = inner
        self.config: dict[str, Any] = dict(config or {})
        self.eos_token: str | None = _token_string(self.config.get("eos_token"))
        self.bos_token: str | None = _token_string(self.config.get("bos_token"))
        self.pad_token: str | None = _token_string(self.config.get("pad_token"))
        self.unk_token: str | None = _token_string(self.config.get("unk_token"))
        self._as_text: tokenizers.Tokenizer | None = None  # a copy that encodes special-token strings as text
        self._as_text_lock = threading.Lock()
        self._max_token_bytes: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """Load `<path>/tokenizer.json` (+ `tokenizer_config.json` when present).

        Returns:
            the Tokenizer, or None when the directory holds no `tokenizer.json`.
        Raises:
            ValueError: when tokenizer.json or tokenizer_config.json exists but cannot be parsed.
        """
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            return None
        try:
            inner = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception subclass on malformed files
            raise ValueError(f"cannot load {tok_file}: {exc}") from exc
        return cls(inner, read_tokenizer_config(root))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (base vocabulary + added tokens).

        The model's embedding may be larger (padded; Qwen3.5: 248320); ids past this never decode to text.
        """
        return int(self._inner.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The tokenizer's tokenizer.json form (a `tokenizers` serialization; grammar engines read it)."""
        return str(self._inner.to_str())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no BOS/EOS or template tokens added.

        Added special-token strings that appear in the text (e.g. `<|im_start|>`) map to their single ids, so a
        rendered chat prompt encodes to exactly the ids the model was trained on.
        """
        if len(text) > _GIL_FREE_CHARS:  # the same ids; encode_batch releases the GIL while it works
            return list(self._inner.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self._inner.encode(text, add_special_tokens=False).ids)

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with special-token strings (e.g. `<|im_start|>`) encoded as ordinary text, never
        as their control ids (transformers' `split_special_tokens`): for text a user wrote."""
        with self._as_text_lock:
            if self._as_text is None:
                inner = tokenizers.Tokenizer.from_str(self._inner.to_str())
                inner.encode_special_tokens = True
                self._as_text = inner
        return list(self._as_text.encode_batch([text], add_special_tokens=False)[0].ids)

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: the longest decoded token (added and
        special tokens included), plus 4 for decoders that drop a token's leading space or marker when it is
        decoded alone. So a text of B bytes needs at least B / max_token_bytes tokens, a bound read without
        tokenizing. Computed once (one batch decode of the vocabulary)."""
        if self._max_token_bytes is None:
            pieces = self._inner.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            self._max_token_bytes = max((len(p.encode("utf-8", "surrogatepass")) for p in pieces), default=1) + 4
        return self._max_token_bytes

    def special_token_strings(self) -> list[str]:
        """The strings of the added tokens marked special (the control tokens: `<|im_start|>`, `<|im_end|>`,
        ...), longest first."""
        found = {t.content for t in self._inner.get_added_tokens_decoder().values() if t.special and t.content}
        return sorted(found, key=lambda t: (-len(t), t))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Incomplete UTF-8 byte sequences decode to U+FFFD (lossy).

        Raises:
            ValueError: on a negative id. (Ids past the vocabulary decode to nothing, as in `tokenizers`.)
        """
        id_list = [int(i) for i in ids]
        if any(i < 0 for i in id_list):
            raise ValueError(f"negative token id in {id_list[:8]}...")
        return str(self._inner.decode(id_list, skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int | None:
        """Id of one vocabulary string (e.g. "<|im_end|>"), or None when it is not a single token."""
        found = self._inner.token_to_id(token)
        return None if found is None else int(found)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary string of one id (byte-level form, e.g. "Ġthe"), or None when out of range."""
        found = self._inner.id_to_token(int(token_id))
        return None if found is None else str(found)

    def _special_id(self, token: str | None) -> int | None:
        return None if token is None else self.token_id(token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of tokenizer_config.json's eos_token (Qwen3.5: <|im_end|> = 248046), or None."""
        return self._special_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        """Id of tokenizer_config.json's bos_token (Qwen3.5: null, so None)."""
        return self._special_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        """Id of tokenizer_config.json's pad_token (Qwen3.5: <|endoftext|> = 248044), or None."""
        return self._special_id(self.pad_token)

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh IncrementalDetokenizer over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    A token may carry only part of a character's bytes (byte-level BPE pieces, or byte-fallback tokens like
    `<0xE2>`); decoding it alone gives U+FFFD. The standard remedy (vLLM's `detokenize_incrementally`, HF's
    `TextStreamer`): keep the ids, decode a window that starts at the previous emission's first token, and emit
    the window's text past the previous emission only when it grew and does not end in U+FFFD.

    Invariant: `"".join(pushes) + flush() == tokenizer.decode(all ids)`, and no piece holds U+FFFD unless the
    full decode does. Both window decodes start at the same token, so first-token handling (Metaspace/Strip
    dropping a leading space) cancels out. Exception: the ByteFallback decoder turns a whole run of `<0xXX>`
    tokens into U+FFFDs when the run is invalid UTF-8, so on such (malformed) output an ASCII byte already
    emitted may show as U+FFFD in the full decode; ByteLevel (Qwen) decodes lossily per byte and always agrees.

    Args:
        tokenizer: the Tokenizer to decode with.
        skip_special_tokens: passed to every decode.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: first token of the last emitted chunk
        self._read_offset = 0  # tokens [0, read_offset) have been emitted as text

    @property
    def ids(self) -> list[int]:
        """All ids pushed so far (a copy)."""
        return list(self._ids)

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Return the text still held back (may contain U+FFFD for bytes that never completed) and reset it."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
