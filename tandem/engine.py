"""The importable engine: load a checkpoint, turn a prompt into tokens, run rounds until a stop, stream text.

A round here is a plain decode step (speculative rounds plug in through the same loop). The loop is
model-agnostic: it reads the model only through its adapter's verbs (``new_state``, ``prefill``, ``decode``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.chat import ChatTemplate
from tandem.config import read_config
from tandem.models.registry import resolve
from tandem.sampling import PenaltyState, SamplingParams, choose_token, logprobs_of
from tandem.tokenizer import Tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "default"
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


@dataclass
class TokenLogprob:
    """Log-probability of a generated token and the top alternatives (ids, natural log)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenerationChunk:
    """What one round commits: new token ids, the new text (complete UTF-8, stop strings held back) and, on the
    last chunk, why generation ended ("stop": an eos id or a stop string; "length": max_tokens or the context).
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Completion:
    """A whole generation: prompt and output ids, text, finish reason and timing (seconds)."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float
    decode_s: float
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Constraint(Protocol):
    """A token-level constraint (a grammar) that masks the logits of each generated position.

    ``allowed()`` returns a [V] bool mask of the tokens allowed next (None: no restriction); ``advance(token)``
    consumes the chosen token. The engine applies the mask before sampling, so masked tokens are never drawn.
    """

    def allowed(self) -> np.ndarray | None: ...

    def advance(self, token_id: int) -> None: ...


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the context for a generated token."""


class Engine:
    """One model, its tokenizer and chat template, and the generation loop (one sequence at a time).

    Args:
        model: an adapter instance (e.g. ``Qwen3_5Model``).
        tokenizer, chat_template: None when the checkpoint has no tokenizer files (prompts must be token ids).
        max_context: the longest sequence (prompt + output) in tokens; defaults to the model's
            ``max_position_embeddings`` capped at 32768.
        eos_token_ids: default stop ids (generation_config.json's eos ids).
    """

    def __init__(self, model: Any, tokenizer: Tokenizer | None, chat_template: ChatTemplate | None,
                 max_context: int | None = None, eos_token_ids: Sequence[int] = (), name: str = "model") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        limit = int(model.hp.max_position_embeddings)
        self.max_context = min(limit, max_context if max_context is not None else 32768)
        self.eos_token_ids = list(eos_token_ids)
        self.name = name
        self.vocab_size = int(model.hp.vocab_size)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "cpu", max_context: int | None = None,
                        progress: bool = False) -> "Engine":
        """Load a checkpoint directory (default: the embedded model) on ``device`` ("cpu", "cuda", "auto").

        Raises:
            ConfigError / CheckpointError: bad config or weights. ValueError: unknown or unavailable device.
        """
        root = Path(path) if path is not None else DEFAULT_MODEL
        _resolve_device(device)
        raw = read_config(root)
        adapter = resolve(raw)
        bar = _progress_bar(raw, progress)
        try:
            model = adapter.load(root, progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        eos = list(getattr(model.hp, "eos_token_ids", ()))
        return cls(model, Tokenizer.from_dir(root), ChatTemplate.from_dir(root), max_context, eos, root.name)

    # --------------------------------------------------------------------------------------------- prompts
    def encode_prompt(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt given as text, as chat messages (rendered by the chat template) or as ids.

        Raises: ValueError for an empty prompt, ids outside the vocabulary, or text without a tokenizer.
        """
        if isinstance(prompt, str):
            ids = self._tok().encode(prompt)
        elif len(prompt) and all(isinstance(m, Mapping) for m in prompt):
            if self.chat_template is None:
                raise ValueError("this checkpoint has no chat template; send text or token ids")
            text = self.chat_template.render(list(prompt), tools=tools,  # type: ignore[arg-type]
                                             **dict(chat_template_kwargs or {}))
            ids = self._tok().encode(text)
        else:
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; send token ids")
        return self.tokenizer

    # --------------------------------------------------------------------------------------------- generation
    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 constraint: Constraint | None = None) -> Iterator[GenerationChunk]:
        """Generate from ``prompt``, yielding a chunk per round (the last one carries finish_reason).

        ``cancelled`` is polled once a round (a True ends generation with finish_reason "abort");
        ``constraint`` masks every position's logits (structured outputs, forced tool calls).

        Raises:
            ValueError: invalid params or prompt. PromptTooLongError: the prompt fills the context.
        """
        params = (params or SamplingParams()).validate()
        ids = self.encode_prompt(prompt, tools, chat_template_kwargs)
        return self._run(ids, params, cancelled, constraint)

    def _run(self, ids: list[int], params: SamplingParams, cancelled: Callable[[], bool] | None,
             constraint: Constraint | None = None) -> Iterator[GenerationChunk]:
        if len(ids) >= self.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_context} (prompt + output)")
        seed = params.resolved_seed()
        stop_ids = set() if params.ignore_eos else set(
            params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
        budget = min(params.max_tokens, self.max_context - len(ids))
        state = self.model.new_state(len(ids) + budget)
        penalties = PenaltyState.from_params(params, self.vocab_size, ids)
        stops = _StopMatcher(params.stop)
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        logits = self.model.prefill(state, ids)
        for n in range(budget):
            mask = constraint.allowed() if constraint is not None else None
            masked = logits if mask is None else np.where(mask, logits, np.float32(-np.inf)).astype(np.float32)
            token = choose_token(masked, params, penalties if penalties.active else None, seed, state.length)
            penalties.add(token)
            if constraint is not None:
                constraint.advance(token)
            lp = [_logprob(logits, token, params.logprobs)] if params.logprobs is not None else []
            if token in stop_ids:  # the eos token's own text is not part of the output
                yield GenerationChunk([token], stops.finish(detok), "stop", lp)
                return
            text, hit = stops.push(detok.push(token) if detok is not None else "")
            if hit:
                yield GenerationChunk([token], text, "stop", lp)
                return
            last = n == budget - 1
            if last or (cancelled is not None and cancelled()):
                yield GenerationChunk([token], text + stops.finish(detok), "length" if last else "abort", lp)
                return
            yield GenerationChunk([token], text, None, lp)
            logits = self.model.decode(state, token)

    def complete(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Completion:
        """Run ``generate`` to the end and collect ids, text, finish reason and timing."""
        params = (params or SamplingParams()).validate()
        ids = self.encode_prompt(prompt, kwargs.get("tools"), kwargs.get("chat_template_kwargs"))
        t0 = time.perf_counter()
        first: float | None = None
        out: list[int] = []
        texts: list[str] = []
        lps: list[TokenLogprob] = []
        finish = "length"
        for chunk in self._run(ids, params, kwargs.get("cancelled"), kwargs.get("constraint")):
            first = first if first is not None else time.perf_counter()
            out += chunk.token_ids
            texts.append(chunk.text)
            lps += chunk.logprobs
            finish = chunk.finish_reason or finish
        t1 = time.perf_counter()
        first = first if first is not None else t1
        return Completion(ids, out, "".join(texts), finish, first - t0, t1 - first, lps)


def _logprob(logits: np.ndarray, token: int, k: int | None) -> TokenLogprob:
    lp, top = logprobs_of(logits, token, k or 0)
    return TokenLogprob(token, lp, top)


class _StopMatcher:
    """Finds stop strings in streamed text; holds back any tail that could start a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit — text after it is dropped)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return buf[:cut], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def finish(self, detok: Any) -> str:
        """At the end of generation: the detokenizer's held bytes (still checked for a stop string) and any
        held-back tail."""
        text, hit = self.push(detok.flush() if detok is not None else "")
        out, self.pending = self.pending, ""
        return text if hit else text + out


def _resolve_device(device: str) -> str:
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "cuda":
        raise ValueError("the CUDA backend is not available in this build yet; use --device cpu")
    return "cpu"


def _progress_bar(raw: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=int(raw.text.get("num_hidden_layers", 0)), desc="loading layers", unit="layer", leave=False)
