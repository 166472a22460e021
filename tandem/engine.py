"""The importable engine: load a checkpoint, turn a prompt into tokens, run rounds until a stop, stream text.

A round is a plain decode step or, with speculation (``spec``), draft → verify → accept → commit
(DESIGN.md, "What runs, in one round"). The loop is model-agnostic: it reads the model only through its adapter's
verbs (``new_state``, ``prefill``, ``decode``; ``new_tree_scratch``, ``verify_tree``, ``commit`` to speculate).

Exactness of speculation: every token is chosen by one chooser (``_constraint_choose``: ``choose_token`` on the host,
or its device twin for device logits without penalties or masks) from logits with a plain decode's bits, at its
absolute position, with the penalty history of the committed path, and pushed through the same stop logic, so
speculative output equals plain output token for token (greedy or seeded sampling), finish reason included.
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
from tandem.spec.speculator import Speculator
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
class RoundStats:
    """One round: tokens it committed (emitted), nodes verified (1 = a plain decode step) and times in ms."""

    num_tokens: int
    num_nodes: int
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0


@dataclass
class GenerationStats:
    """Rounds of one generation (prefill's first token is not a round)."""

    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        """Number of rounds."""
        return len(self.rounds)

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens committed per round (0.0 without rounds)."""
        return sum(r.num_tokens for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    def totals_ms(self) -> dict[str, float]:
        """Total draft, verify and commit ms."""
        return {"draft_ms": sum(r.draft_ms for r in self.rounds), "verify_ms": sum(r.verify_ms for r in self.rounds),
                "commit_ms": sum(r.commit_ms for r in self.rounds)}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary: rounds, tokens_per_round, nodes_per_round, total ms."""
        nodes = sum(r.num_nodes for r in self.rounds)
        return {"rounds": self.num_rounds, "tokens_per_round": self.tokens_per_round,
                "nodes_per_round": nodes / self.num_rounds if self.rounds else 0.0, **self.totals_ms()}


@dataclass
class GenerationChunk:
    """What one round commits: new token ids, the new text (complete UTF-8, stop strings held back) and, on the
    last chunk, why generation ended ("stop": an eos id or a stop string; "length": max_tokens or the context).
    ``stats``: the round's stats (None for the chunk of prefill's first token).
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: RoundStats | None = None


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
    stats: GenerationStats | None = None


class Constraint(Protocol):
    """A token-level constraint (a grammar) that masks the logits of each generated position.

    ``allowed()`` returns a [V] bool mask of the tokens allowed next (None: no restriction); ``advance(token)``
    consumes the chosen token. The engine applies the mask before sampling, so masked tokens are never drawn.
    Optional: ``valid_prefix(tokens) -> int``, how many leading tokens of a draft path the constraint would
    accept from its current state, without consuming them; speculation uses it to prune draft nodes.
    """

    def allowed(self) -> np.ndarray | None: ...

    def advance(self, token_id: int) -> None: ...


def _constraint_choose(logits: Any, constraint: Constraint | None, params: SamplingParams,
                       penalties: PenaltyState | None, seed: int, position: int) -> int:
    """Choose a token under the constraint's mask (the same code for plain and speculative rounds) and advance
    the constraint with it.

    ``logits`` [V] float32 is a NumPy array (CPU backend) or a device array (CUDA backend). On the device, a
    choice with no constraint and no penalties is made there (``_device_choose``: only the id crosses); any other
    choice copies the row to the host and runs the CPU code.
    Raises: ValueError when no token is left to choose (every logit -inf or NaN, or masked).
    """
    if not isinstance(logits, np.ndarray):
        if constraint is None and penalties is None:
            return _device_choose(logits, params, seed, position)
        logits = _host(logits)
    mask = constraint.allowed() if constraint is not None else None
    masked = logits if mask is None else np.where(mask, logits, np.float32(-np.inf)).astype(np.float32)
    token = choose_token(masked, params, penalties, seed, position)
    if constraint is not None:
        constraint.advance(token)
    return token


def _host(logits: Any) -> np.ndarray:
    """Logits as a host NumPy float32 array (a device array is copied; a NumPy array is returned as is)."""
    if isinstance(logits, np.ndarray):
        return logits
    return np.asarray(logits.get(), dtype=np.float32)


def _device_choose(logits: Any, params: SamplingParams, seed: int, position: int) -> int:
    """``choose_token`` of device logits [V] without penalties, on the device: the argmax (first maximum, exact)
    for greedy params, else tandem/backend/cuda/sample.py's sampler (the same Gumbel-max draw keyed by (seed,
    position, id); the id equals the CPU's except where a top-p / min-p cut or two candidates lie within float
    rounding). Only the id is copied back. Raises: ValueError when no token is left (choose_token's error)."""
    return _checked_id(_device_choose_rows(logits.reshape(1, -1), params, seed, [position])[0])


def _device_choose_rows(logits: Any, params: SamplingParams, seed: int, positions: list[int]) -> list[int]:
    """``_device_choose`` of every row of device logits [N, V] at its position, in one launch and one copy (a
    verified tree's nodes: each row's id is the one ``_device_choose`` gives it alone, the sampler being
    row-invariant). -1 marks a row with no token left (``_checked_id`` raises when the walk takes it)."""
    from tandem.backend.cuda.sample import sample_rows

    ids = sample_rows(logits, params.temperature, params.top_k, params.top_p, params.min_p, seed, positions)
    return [int(t) for t in ids.get()]


def _checked_id(token: int) -> int:
    """A device-chosen id; -1 (the sampler found no candidate) raises choose_token's ValueError."""
    if token < 0:
        raise ValueError("every token is masked (logits all -inf or NaN)")
    return token


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
        spec: speculation mode, "off", "lookup", "mtp" or "auto" (tandem/spec/speculator.py). Tests and tools
            may set ``engine.speculator`` directly (custom drafters or policy).
    Attributes:
        last_stats: the rounds of the latest generation (updated as it runs).
        run_ahead: plain rounds on a device model (no masks or logprobs) queue each step before reading the id
            it consumes (default True; False reads every id before launching the next step).
    A device model's state (``reuses_states``) is allocated for ``max_context`` tokens, kept when its sequence ends
    and reused (reset in place) by the next: its recorded launch plans (decode, each verify size, each commit length)
    hold pointers into its buffers, so they replay instead of being recorded again for every request. Its KV cache
    is the context's, as llama.cpp's n_ctx (fp32: 128 KB a token at the 27B shape, 4.3 GB at 32768 tokens). A
    sequence takes the kept state, so no second one is held while one runs. ``release_state`` lets it go.
    """

    def __init__(self, model: Any, tokenizer: Tokenizer | None, chat_template: ChatTemplate | None,
                 max_context: int | None = None, eos_token_ids: Sequence[int] = (), name: str = "model",
                 spec: str = "off") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        limit = int(model.hp.max_position_embeddings)
        self.max_context = min(limit, max_context if max_context is not None else 32768)
        self.eos_token_ids = list(eos_token_ids)
        self.name = name
        self.vocab_size = int(model.hp.vocab_size)
        self.speculator: Speculator | None = Speculator.for_mode(model, spec, model_name=name)
        self.last_stats = GenerationStats()
        # a device model's verbs return before its work is done: wait before reading a round's clock
        self._sync: Callable[[], None] = getattr(model, "synchronize", None) or _no_sync
        self.run_ahead = True  # see Attributes; ``_run_ahead``
        self._spare_state: Any = None  # a device state of an ended sequence, kept for the next (``_take_state``)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "cpu", max_context: int | None = None,
                        progress: bool = False, spec: str = "off") -> "Engine":
        """Load a checkpoint directory (default: the embedded model) on ``device`` ("cpu", "cuda", "auto"),
        speculating with ``spec`` ("off", "lookup", "mtp", "auto").

        Raises:
            ConfigError / CheckpointError: bad config or weights. ValueError: unknown or unavailable device.
        """
        root = Path(path) if path is not None else DEFAULT_MODEL
        resolved = _resolve_device(device)
        raw = read_config(root)
        adapter = resolve(raw)
        bar = _progress_bar(raw, progress)
        try:
            model = adapter.load(root, progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        if resolved != "cpu":
            if not hasattr(model, "on_device"):
                raise ValueError(f"the {adapter.__name__} adapter has no {resolved} backend; use --device cpu")
            model = model.on_device(resolved)
        eos = list(getattr(model.hp, "eos_token_ids", ()))
        return cls(model, Tokenizer.from_dir(root), ChatTemplate.from_dir(root), max_context, eos, root.name, spec)

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
        state = self._take_state(len(ids) + budget)
        try:
            yield from self._generate(ids, params, cancelled, constraint, state, seed, stop_ids, budget)
        finally:
            self._keep_state(state)

    def _take_state(self, max_len: int) -> Any:
        """A state for a sequence of at most ``max_len`` tokens: the kept one when it is large enough (reset in place,
        its launch plans still recorded), else a new one: of ``max_context`` tokens for a model that reuses its
        states (``reuses_states``: the CUDA model), so that every later sequence fits it, else of ``max_len``."""
        spare, self._spare_state = self._spare_state, None
        if spare is not None and spare.max_len >= max_len:
            spare.reset()
            return spare
        spare = None  # too small: let it go before the new one is allocated
        if getattr(self.model, "reuses_states", False):
            max_len = max(max_len, self.max_context)
        return self.model.new_state(max_len)

    def release_state(self) -> None:
        """Let go of the device state kept from the last sequence (its KV cache and launch plans: at 27B about
        4.3 GB of fp32 KV for a 32k-token sequence, plus up to ~236 MB of verify plans); the next sequence allocates
        and records anew. Idle memory only: a running sequence keeps its own state."""
        self._spare_state = None

    def _keep_state(self, state: Any) -> None:
        """Keep an ended sequence's state for the next one, for a model that reuses its states (``reuses_states``:
        every such state holds ``max_context`` tokens). Host states are not kept: they record no plans, and a fresh
        zeroed array costs nothing until written."""
        if getattr(self.model, "reuses_states", False):
            self._spare_state = state

    def _generate(self, ids: list[int], params: SamplingParams, cancelled: Callable[[], bool] | None,
                  constraint: Constraint | None, state: Any, seed: int, stop_ids: set[int], budget: int
                  ) -> Iterator[GenerationChunk]:
        penalties = PenaltyState.from_params(params, self.vocab_size, ids)
        stops = _StopMatcher(params.stop)
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        self.last_stats = stats = GenerationStats()
        out = _Output(params, stop_ids, stops, detok, budget)
        if self.speculator is not None:
            yield from self._run_spec(self.speculator, ids, state, params, seed, penalties, out, stats, cancelled,
                                      constraint)
            return
        pen = penalties if penalties.active else None
        logits = self.model.prefill(state, ids)
        if self.run_ahead and constraint is None and params.logprobs is None \
                and hasattr(self.model, "choose_on_device") and not isinstance(logits, np.ndarray):
            yield from self._run_ahead(logits, state, params, seed, pen, out, stats, budget, cancelled)
            return
        round_stats: RoundStats | None = None
        while True:  # plain rounds: one decode step each
            token = _constraint_choose(logits, constraint, params, pen, seed, state.length)
            penalties.add(token)
            finish = out.push_polled(token, logits, cancelled)
            yield out.chunk(finish, round_stats)
            if finish is not None:
                return
            t0 = time.perf_counter()
            logits = self.model.decode(state, token)
            self._sync()
            round_stats = RoundStats(1, 1, verify_ms=(time.perf_counter() - t0) * 1e3)
            stats.rounds.append(round_stats)

    def _run_ahead(self, logits: Any, state: Any, params: SamplingParams, seed: int, pen: PenaltyState | None,
                   out: "_Output", stats: GenerationStats, budget: int, cancelled: Callable[[], bool] | None
                   ) -> Iterator[GenerationChunk]:
        """Plain rounds on a device model without masks or logprobs, one step ahead: each id is chosen on the
        device (``model.choose_on_device``: the argmax, or the sampler at (seed, position) as ``_device_choose``,
        after the penalties ``pen``, whose counts the device keeps from here on) and the step that consumes it is
        queued before the host reads it, so the GPU does not wait for the host's id read, detokenizing and launches
        between steps. The tokens are the plain loop's (the same kernels and bits; tests/test_cuda_engine.py). The
        step queued after the last token (an eos or a stop string: the budget's end is known and never run past) is
        discarded: its id is never read, and the state is reset before it is used again (``_take_state``).
        A round's ``verify_ms`` is the host time between two ids' arrivals (one step, once the loop is going).
        Raises: ValueError when the sampler finds no token left (as choose_token).
        """
        model = self.model
        pending = model.choose_on_device(state, logits, params, seed, state.length, pen)
        round_stats: RoundStats | None = None
        last = 0.0  # when the previous id arrived
        while True:
            follow = None
            if out.count + 1 < budget:  # the id being read is not the budget's last: queue its step first
                following = model.decode(state, pending)
                follow = model.choose_on_device(state, following, params, seed, state.length, pen)
            token = _checked_id(pending.get())
            now = time.perf_counter()
            if out.count:  # this id came from a decode step: the round is the time since the last id
                round_stats = RoundStats(1, 1, verify_ms=(now - last) * 1e3)
                stats.rounds.append(round_stats)
            last = now
            finish = out.push_polled(token, None, cancelled)
            yield out.chunk(finish, round_stats)
            if finish is not None:
                return
            assert follow is not None  # out.push ends the generation at the budget
            pending = follow

    def _run_spec(self, spec: Speculator, ids: list[int], state: Any, params: SamplingParams, seed: int,
                  penalties: PenaltyState, out: _Output, stats: GenerationStats,
                  cancelled: Callable[[], bool] | None, constraint: Constraint | None = None
                  ) -> Iterator[GenerationChunk]:
        """Speculative rounds. Each round: the pending root token (chosen, emitted, not yet run) plus the
        drafters' guesses are verified in one pass; the walk from the root chooses each next token from the
        verified logits exactly as a plain decode would, accepting a guess when it equals the choice; the
        accepted path is committed and the last choice (the bonus token) becomes the next root. A constraint
        masks every choice as in a plain round, and prunes guesses it would never allow."""
        model, pen = self.model, (penalties if penalties.active else None)
        valid_prefix = getattr(constraint, "valid_prefix", None)
        hidden: list[np.ndarray] | None = [] if spec.needs_hidden else None
        logits = model.prefill(state, ids, hidden_out=hidden) if hidden is not None else model.prefill(state, ids)
        spec.reset(list(ids), np.concatenate(hidden) if hidden is not None else None, state.max_len)
        token = _constraint_choose(logits, constraint, params, pen, seed, state.length)
        penalties.add(token)
        finish = out.push(token, logits)
        round_stats: RoundStats | None = None
        while True:
            if finish is None and cancelled is not None and cancelled():
                finish = out.abort()
            yield out.chunk(finish, round_stats)
            if finish is not None:
                return
            t0 = time.perf_counter()
            tree = spec.draft(token, out.budget - out.count - 1, valid_prefix)
            t1 = time.perf_counter()
            recorded = spec.recordings()  # work that records a launch plan is left out of the prices
            if len(tree) == 1:  # StairCut (or the drafters) chose a plain step
                hid: list[np.ndarray] | None = [] if hidden is not None else None
                logits = model.decode(state, token, hidden_out=hid) if hid is not None else model.decode(state, token)
                self._sync()
                t2 = time.perf_counter()
                spec.extend([token], np.concatenate(hid) if hid is not None else None)
                if spec.recordings() == recorded:
                    spec.curve.observe(1, (t2 - t1) * 1e3)
                token = _constraint_choose(logits, constraint, params, pen, seed, state.length)
                penalties.add(token)
                finish = out.push(token, logits)
                round_stats = RoundStats(1, 1, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
                stats.rounds.append(round_stats)
                continue
            all_logits = model.verify_tree(state, spec.scratch, tree.token_ids, tree.parent_ids)
            self._sync()
            t2 = time.perf_counter()
            chosen: list[int] | None = None  # device rows without masks or penalties: every node's choice at once
            if constraint is None and pen is None and not isinstance(all_logits, np.ndarray):
                chosen = _device_choose_rows(all_logits[:len(tree)], params, seed,
                                             [state.length + d + 1 for d in tree.depths])
            node, path, num = 0, [0], 0
            while True:  # the accept walk
                row = all_logits[node]
                token = _checked_id(chosen[node]) if chosen is not None else \
                    _constraint_choose(row, constraint, params, pen, seed, state.length + tree.depths[node] + 1)
                penalties.add(token)
                num += 1
                finish = out.push(token, row)
                child = tree.child_with(node, token)
                if finish is not None or child < 0:
                    break
                node = child
                path.append(node)
            t3 = time.perf_counter()
            verify_priced = spec.recordings() == recorded  # the verify's own recording (a new tree size)
            recorded = spec.recordings()
            if finish is None:  # a finished generation needs no commit
                model.commit(state, spec.scratch, path)
                self._sync()
                spec.extend([tree.token_ids[n] for n in path],
                            spec.scratch.hidden[np.asarray(path)] if hidden is not None else None)
            t4 = time.perf_counter()
            # the price of a verify is what the round spends on the tree: the pass and the accept walk (its rows'
            # choices: on a device one launch and a read), next to a plain step's decode
            spec.observe(tree, path, (t3 - t1) * 1e3, (t4 - t3) * 1e3, priced=verify_priced,
                         commit_priced=spec.recordings() == recorded)  # the commit's (a new path length)
            round_stats = RoundStats(num, len(tree), (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t4 - t3) * 1e3)
            stats.rounds.append(round_stats)

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
        return Completion(ids, out, "".join(texts), finish, first - t0, t1 - first, lps, self.last_stats)


def _logprob(logits: Any, token: int, k: int | None) -> TokenLogprob:
    lp, top = logprobs_of(_host(logits), token, k or 0)
    return TokenLogprob(token, lp, top)


class _Output:
    """The tokens of one generation as they are chosen: stop ids, stop strings, the token budget, logprobs, and
    the pending chunk. Plain and speculative rounds both push every token through it, so they stop alike."""

    def __init__(self, params: SamplingParams, stop_ids: set[int], stops: _StopMatcher, detok: Any,
                 budget: int) -> None:
        self.params, self.stop_ids, self.stops, self.detok, self.budget = params, stop_ids, stops, detok, budget
        self.count = 0
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] = []

    def push(self, token: int, logits: Any) -> str | None:
        """Add a chosen token (``logits``: the raw logits it was chosen from, host or device); returns the finish reason if it ends
        generation ("stop": eos id or stop string; "length": the budget)."""
        self.count += 1
        self.token_ids.append(token)
        if self.params.logprobs is not None:
            self.logprobs.append(_logprob(logits, token, self.params.logprobs))
        if token in self.stop_ids:  # the eos token's own text is not part of the output
            self.text += self.stops.finish(self.detok)
            return "stop"
        text, hit = self.stops.push(self.detok.push(token) if self.detok is not None else "")
        self.text += text
        if hit:
            return "stop"
        if self.count >= self.budget:
            self.text += self.stops.finish(self.detok)
            return "length"
        return None

    def push_polled(self, token: int, logits: Any, cancelled: Callable[[], bool] | None) -> str | None:
        """``push``, then, if the generation goes on, poll ``cancelled`` (True: ``abort``); the finish reason."""
        finish = self.push(token, logits)
        if finish is None and cancelled is not None and cancelled():
            finish = self.abort()
        return finish

    def abort(self) -> str:
        """End generation on cancellation: flush held text; returns "abort"."""
        self.text += self.stops.finish(self.detok)
        return "abort"

    def chunk(self, finish: str | None, stats: RoundStats | None) -> GenerationChunk:
        """The pending tokens and text as a chunk (and start a new one)."""
        c = GenerationChunk(self.token_ids, self.text, finish, self.logprobs, stats)
        self.token_ids, self.text, self.logprobs = [], "", []
        return c


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
    """"cpu" or "cuda" for a requested device: "auto" is "cuda" when CuPy sees a GPU, else "cpu".

    Raises: ValueError for an unknown name, or "cuda" without CuPy or a visible GPU (the message says which).
    """
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "cpu":
        return "cpu"
    from tandem.backend.cuda.loader import gpu_available

    if gpu_available():
        return "cuda"
    if device == "auto":
        return "cpu"
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise ValueError("--device cuda needs CuPy (the cuda12 or cuda13 extra: pip install -e '.[cuda12]' "
                         "or '.[cuda13]'); "
                         "use --device cpu or auto") from None
    raise ValueError("--device cuda: CuPy sees no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES); "
                     "use --device cpu or auto")


def _no_sync() -> None:
    """The CPU backend's synchronize: its verbs return when their work is done."""


def _progress_bar(raw: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=int(raw.text.get("num_hidden_layers", 0)), desc="loading layers", unit="layer", leave=False)
