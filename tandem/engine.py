"""The importable engine: load a checkpoint, turn a prompt into tokens, run rounds until a stop, stream text.

A round is a plain decode step or, with speculation (``spec``), draft → verify → accept → commit
(DESIGN.md, "What runs, in one round"). The loop is model-agnostic: it reads the model only through its adapter's
verbs (``new_state``, ``prefill``, ``decode``; ``new_tree_scratch``, ``verify_tree``, ``commit`` to speculate).

The speculative rounds live in tandem/speculative/rounds.py, the choosers in tandem/choose.py, stop handling in
tandem/output.py and the output types in tandem/generation.py.

Exactness of speculation: every token is chosen by one chooser (``choose.constraint_choose``: ``choose_token`` on the
host, or its device twin for device logits without penalties or masks) from logits with a plain decode's bits, at its
absolute position, with the penalty history of the committed path, and pushed through the same stop logic, so
speculative output equals plain output token for token (greedy or seeded sampling), finish reason included.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tandem.cache.sequence import PREFILL_CHUNK, PrefillCancelled, PrefillModel, SequenceCache
from tandem.cache.store import PrefixCache
from tandem.chat import ChatTemplate, render_segments
from tandem.choose import checked_id, constraint_choose
from tandem.config import read_config
from tandem.image_fetch import ImageFetcher
from tandem.images import ImageLimits, PreparedImage
from tandem.generation import (Completion, Constraint, GenerationChunk, GenerationStats, PromptTooLongError, RoundStats,
                               TokenLogprob)
from tandem.dtypes import kv_dtype_name
from tandem.models.protocol import (DeviceLimitError, Model, device_sampler, joint_forward, kv_storage, placeable,
                                    synchronizer, tensor_parallel_layout)
from tandem.models.registry import resolve
from tandem.multimodal import attach_images, encode_with_images, image_spec_of, set_vision_mode
from tandem.output import Output, StopMatcher
from tandem.sampling import PenaltyState, SamplingParams
from tandem.slots import JointRounds, Slot, SlotModel, SlotPool, run_alone
from tandem.speculative.rounds import speculative_rounds
from tandem.speculative.speculator import Speculator, default_mode
from tandem.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "Completion", "Constraint", "Engine", "GenerationChunk", "GenerationStats",
           "Prompt", "PromptTooLongError", "RoundStats", "TokenLogprob"]

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "default"
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]



def _load_mesh(adapter: Any, root: Path, device: str, n: int, devices: Sequence[int] | None, spec: str) -> Any:
    """``from_pretrained``'s model for ``tensor_parallel`` n: the mesh of the adapter's layout
    (tandem/parallel/load.py) on ``device`` (the ranks on ``devices``, default GPUs 0..n-1). Raises: ValueError (n < 1, an adapter without a
    tensor-parallel layout, too few GPUs, a rank dimension the kernels cannot serve, spec "mtp"), ConfigError (a
    dimension n does not divide), CheckpointError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel (--tensor-parallel) must be an integer of at least 1, got {n!r}")
    layout = tensor_parallel_layout(adapter)
    if layout is None:
        raise ValueError(f"the {getattr(adapter, '__name__', adapter)} adapter has no tensor-parallel layout; "
                         f"use --tensor-parallel 1")
    if spec == "mtp":
        raise ValueError(f"--tensor-parallel {n} speculates by prompt lookup only (no MTP head over the mesh); "
                         f"use --spec lookup or auto")
    try:
        from tandem.parallel.load import load_mesh

        return load_mesh(layout, root, n, device, devices)
    except DeviceLimitError as e:
        raise ValueError(f"--device {device} --tensor-parallel {n}: {e}") from None


def _set_kv_dtype(model: Any, kv_dtype: str | None) -> None:
    """Set the adapter's KV storage: ``kv_dtype`` ("bf16" / "fp32"; None: bf16) where it declares a choice.

    Raises: ValueError for an unknown name, a storage the adapter does not offer, or an explicit ``kv_dtype`` for an
    adapter without the choice.
    """
    name = kv_dtype_name(kv_dtype if kv_dtype is not None else "bf16")
    storage = kv_storage(model)
    if storage is None:
        if kv_dtype is not None:
            raise ValueError(f"the {type(model).__name__} adapter has no choice of KV dtype; leave kv_dtype unset")
        return
    if name not in model.capabilities.kv_dtypes:
        raise ValueError(f"the {type(model).__name__} adapter stores KV rows as {model.capabilities.kv_dtypes}, "
                         f"not {name}")
    storage.kv_dtype = name

class Engine:
    """One model, its tokenizer and chat template, and the generation loop (``parallel`` sequences at a time).

    Args:
        model: an adapter instance (e.g. ``Qwen3_5Model``).
        tokenizer, chat_template: None when the checkpoint has no tokenizer files (prompts must be token ids).
        max_context: the longest sequence (prompt + output) in tokens; defaults to the model's
            ``max_position_embeddings`` capped at 32768.
        eos_token_ids: default stop ids (generation_config.json's eos ids).
        spec: speculation mode, "off", "lookup", "mtp" or "auto" (tandem/speculative/speculator.py). Tests and tools
            may set ``engine.speculator`` directly (custom drafters or policy).
        cache: the prefix cache (tandem/cache/store.py; None: every prompt is prefilled from token 0).
        prefix_chunk: the prefill piece and snapshot grid in tokens, a multiple of 64 (default: the cache's chunk,
            else DEFAULT_PREFIX_CHUNK); ``cancelled`` is polled between pieces.
        parallel: sequence slots (tandem/slots.py): up to this many generations run at once, from as many threads,
            each with its own state and speculator, their model calls interleaved; a generation past the last free
            slot waits for one. With 1 (the default) ``speculator`` is the one slot's; with more, every slot builds
            its own for ``spec``.
        joint_rounds: with ``parallel`` > 1, gather the slots' decode steps and verify passes into joint forward
            passes (tandem/slots.py ``JointRounds``); None (default): where the model declares
            ``capabilities.joint_rounds``. True on a model without it runs each gathered item through its own verb
            (the rounds' bookkeeping without the shared weight reads: tests use it on the CPU).
    Attributes:
        last_cached_tokens: prompt tokens the calling thread's latest generation restored from the cache (OpenAI's
            cached_tokens).
        last_stats: the rounds of the calling thread's latest generation (updated as it runs).
        last_slot: the slot index the calling thread's latest generation ran in.
        last_cache_tier: the slowest prefix-cache tier the calling thread's latest generation restored its prompt
            from ("resident", "host", "disk"; "" when nothing was restored).
        run_ahead: plain rounds on a device model (no masks or logprobs) queue each step before reading the id
            it consumes (default True; False reads every id before launching the next step). With joint rounds a
            lone slot's steps are queued ahead as without slots; beside others, its step joins a pass whose
            placement reads the id it consumes (cuda_joint ``_place``), so the id is read before that pass.
        spec_max_running: with joint rounds, a slot drafts trees only while at most this many slots are in their
            rounds (default 1: a lone slot, whose verify replays its own recorded plan); past it every slot's round
            is a plain step (its drafters skipped), so the passes are decode rows only and replay their recorded
            joint plans. A pass holding trees runs its launchers directly (cuda_joint.py), about 3.7 ms of host time
            a slot on the 27B shape: 8 slots of lookup trees decoded 239 tok/s against 658 tok/s plain on an H100
            (docs/performance.md, "Several requests at once"). The output is the same either way (speculation is
            exact); as vLLM's speculative_disable_by_batch_size.
        image_limits: what one request's images may be (``ImageLimits``: count, bytes, decoded pixels).
        image_fetcher: fetches http(s) image URLs in chat messages (tandem/image_fetch.py); None (default): such
            URLs are refused with one line.
    A device model's state (``capabilities.reuses_states``) is allocated for ``max_context`` tokens, kept when its
    sequence ends and reused (reset in place) by the next: its recorded launch plans (decode, each verify size, each
    commit length) hold pointers into its buffers, so they replay instead of being recorded again for every request.
    Its KV cache
    is the context's, as llama.cpp's n_ctx (fp32: 128 KB a token at the 27B shape, 4.3 GB at 32768 tokens). A
    sequence takes the kept state, so no second one is held while one runs. ``release_state`` lets it go.
    """

    def __init__(self, model: Model[Any], tokenizer: Tokenizer | None, chat_template: ChatTemplate | None,
                 max_context: int | None = None, eos_token_ids: Sequence[int] = (), name: str = "model",
                 spec: str = "off", cache: PrefixCache | None = None, prefix_chunk: int | None = None,
                 parallel: int = 1, joint_rounds: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.prefix_chunk = check_prefix_chunk(prefix_chunk if prefix_chunk is not None else
                                               cache.chunk if cache is not None else DEFAULT_PREFIX_CHUNK)
        if cache is not None and cache.chunk != self.prefix_chunk:
            raise ValueError(f"prefix_chunk {self.prefix_chunk} differs from the cache's grid {cache.chunk}")
        self._local = threading.local()  # last_cached_tokens, last_stats, last_slot: per calling thread
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        limit = int(model.hp.max_position_embeddings)
        self.max_context = min(limit, max_context if max_context is not None else 32768)
        if max_context is not None and max_context > limit:  # said, not a silent clamp
            logging.getLogger("tandem").warning(
                "max_context %d is above this checkpoint's max_position_embeddings %d: the context holds %d tokens",
                max_context, limit, limit)
        self.eos_token_ids = list(eos_token_ids)
        self.name = name
        self.vocab_size = int(model.hp.vocab_size)
        self.spec_mode = spec
        self.speculator: Speculator | None = Speculator.for_mode(model, spec, model_name=name)
        # a device model's verbs return before its work is done: wait before reading a round's clock
        self._sync: Callable[[], None] = synchronizer(model)
        self.run_ahead = True  # see Attributes; ``_run_ahead``
        self.spec_max_running = 1  # see Attributes
        self.image_limits = ImageLimits()  # per request: image count, bytes, decoded pixels (tandem/images.py)
        self.image_fetcher: ImageFetcher | None = None  # http(s) image URLs refused unless set
        self.slots = SlotPool(parallel, self._make_slot)
        joint = joint_forward(model)
        self.rounds: JointRounds | None = None  # the joint rounds (tandem/slots.py), with parallel > 1
        if parallel > 1 and (joint_rounds or joint_rounds is None and joint is not None):
            alone = run_alone(model)
            self.rounds = JointRounds(joint.joint_forward if joint is not None else alone, self.slots.lock,
                                      alone=alone)

    def _make_slot(self, index: int) -> Slot:
        """Slot ``index``: the model itself when the engine has one slot, else the model under the pool's lock
        (its decode steps and verify passes through the joint rounds, where they run) with a speculator of its
        own."""
        if self.slots.size == 1:
            return Slot(index, self.model, None)  # its speculator is ``self.speculator`` (tests may replace it)
        model = SlotModel(self.model, self.slots.lock, self.rounds, index)
        spec = Speculator.for_mode(model, self.spec_mode, model_name=self.name)
        rounds = self.rounds
        if spec is not None and rounds is not None:  # trees shrink as more slots share a pass's rows, then stop
            def node_cap() -> int:
                running = max(1, rounds.running())
                return JOINT_TREE_ROWS // running if running <= self.spec_max_running else 1

            spec.node_cap = node_cap
        return Slot(index, model, spec)

    def _speculator(self, slot: Slot) -> Speculator | None:
        return self.speculator if self.slots.size == 1 else slot.speculator

    @property
    def parallel(self) -> int:
        """The number of sequence slots."""
        return self.slots.size

    def slot_state_bytes(self) -> int:
        """Bytes of the states the slots hold now (a device model's: one of ``max_context`` tokens a slot once it
        has run, or after ``warm_up``)."""
        return sum(int(s.spare.nbytes()) for s in self.slots.built() if s.spare is not None)

    @property
    def last_cached_tokens(self) -> int:
        return int(getattr(self._local, "cached_tokens", 0))

    @last_cached_tokens.setter
    def last_cached_tokens(self, value: int) -> None:
        self._local.cached_tokens = value

    @property
    def last_stats(self) -> GenerationStats:
        stats = getattr(self._local, "stats", None)
        if stats is None:
            stats = self._local.stats = GenerationStats()
        return stats

    @last_stats.setter
    def last_stats(self, value: GenerationStats) -> None:
        self._local.stats = value

    @property
    def last_slot(self) -> int:
        return int(getattr(self._local, "slot", 0))

    @property
    def last_cache_tier(self) -> str:
        return str(getattr(self._local, "cache_tier", ""))

    @property
    def _spare_state(self) -> Any:
        """Slot 0's kept device state (the one slot's, for an engine of one)."""
        built = self.slots.built()
        return built[0].spare if built and built[0].index == 0 else None

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "cpu", max_context: int | None = None,
                        progress: bool = False, spec: str = "off", cache: str = "on", cache_gb: float | None = None,
                        cache_host_gb: float | None = None, cache_dir: str | Path | None = None,
                        cache_disk_gb: float = 20.0, prefix_chunk: int | None = None,
                        kv_dtype: str | None = None, tensor_parallel: int = 1,
                        tensor_parallel_devices: Sequence[int] | None = None, parallel: int = 1,
                        joint_rounds: bool | None = None, vision: str = "auto", allow_image_urls: bool = False,
                        image_limits: ImageLimits | None = None) -> "Engine":
        """Load a checkpoint directory (default: the embedded model) on ``device`` ("cpu", "cuda", "auto"),
        speculating with ``spec`` ("off", "lookup", "mtp", "auto"; "default": the device's measured mode,
        speculator.default_mode).

        The prefix cache (``cache`` "on" / "off"): ``cache_gb`` resident (device memory on a GPU, host memory on the
        CPU; default 8 / 2), ``cache_host_gb`` pinned host memory for blocks spilled from the device (default 16 on
        a GPU; the CPU has none), ``cache_dir`` the disk tier (off unless given) capped at ``cache_disk_gb``,
        ``prefix_chunk`` the snapshot grid (default 1024 tokens on a GPU, 256 on the CPU).
        ``kv_dtype``: the KV cache's storage, "bf16" (None: the default, where the adapter offers a choice) or
        "fp32"; the CPU and the GPU store the same bits either way.
        ``tensor_parallel``: N > 1 splits the model over N ranks (tandem/parallel: GPUs 0..N-1 on "cuda", or
        ``tensor_parallel_devices``, where one GPU repeated runs every rank on it; simulated ranks on the CPU), the
        same tokens as one rank, the prefix cache over every rank's state; it speculates by prompt lookup only
        ("mtp" is refused, "auto" is lookup).
        ``parallel``: sequence slots (see the class), at least 1; ``joint_rounds`` as the class's.
        ``vision``: "auto" (the checkpoint's vision tower loads when the first image arrives), "on" (now; an
        error without one), "off" (images refused) — tandem/multimodal.py.
        ``allow_image_urls``: fetch http(s) image URLs that chat messages name (an ``ImageFetcher``; the process
        reaches whatever URL a prompt names: docs/security.md); default False refuses them.
        ``image_limits``: the per-request image limits (default ``ImageLimits()``).
        Raises:
            ConfigError / CheckpointError: bad config or weights. ValueError: unknown or unavailable device, a
            model dimension the "cuda" kernels cannot serve (one line naming it; "auto" then loads on the CPU and
            logs that line as a warning), a bad cache option or an unusable cache_dir.
        """
        if cache not in ("on", "off"):
            raise ValueError(f"cache must be 'on' or 'off', got {cache!r}")
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel (--parallel) must be an integer of at least 1, got {parallel!r}")
        root = Path(path) if path is not None else DEFAULT_MODEL
        resolved = _resolve_device(device)
        if spec == "default" and tensor_parallel != 1:
            spec = default_mode(resolved)
        raw = read_config(root)
        adapter = resolve(raw)
        if tensor_parallel != 1 or not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool):
            model = _load_mesh(adapter, root, resolved, tensor_parallel, tensor_parallel_devices, spec)
            _set_kv_dtype(model, kv_dtype)
        else:
            bar = _progress_bar(raw, progress)
            try:
                model = adapter.load(root, progress=bar.update if bar is not None else None)
            finally:
                if bar is not None:
                    bar.close()
            _set_kv_dtype(model, kv_dtype)
            set_vision_mode(model, vision)
            if resolved != "cpu" and device == "auto" and resolved not in model.capabilities.devices:
                resolved = "cpu"  # "auto": the GPU where the adapter has kernels for it, else the CPU
            if resolved != "cpu":
                mover = placeable(model, resolved)
                if mover is None:
                    raise ValueError(f"the {type(model).__name__} adapter has no {resolved} backend; use --device cpu")
                try:
                    model = mover.on_device(resolved)
                except DeviceLimitError as e:  # a dimension the device's kernels cannot serve: one line naming it
                    if device != "auto":
                        raise ValueError(f"--device {resolved}: {e}; use --device cpu or auto") from None
                    logging.getLogger("tandem.engine").warning("--device auto: %s; running on the CPU", e)
                    resolved = "cpu"
        if spec == "default":
            spec = default_mode(resolved)
        eos = list(model.hp.eos_token_ids)
        chunk = check_prefix_chunk(prefix_chunk if prefix_chunk is not None else
                                   1024 if resolved == "cuda" else DEFAULT_PREFIX_CHUNK)
        store = None
        if cache == "on":
            from tandem.cache.build import build_cache

            store = build_cache(model, root, resolved, chunk, 8.0 if resolved == "cuda" else 2.0,
                                cache_gb, (16.0 if resolved == "cuda" else 0.0) if cache_host_gb is None else
                                cache_host_gb, cache_dir, cache_disk_gb)
        engine = cls(model, Tokenizer.from_dir(root), ChatTemplate.from_dir(root), max_context, eos, root.name, spec,
                     store, chunk, parallel, joint_rounds)
        engine.image_limits = image_limits or ImageLimits()
        engine.image_fetcher = ImageFetcher() if allow_image_urls else None
        return engine

    # --------------------------------------------------------------------------------------------- prompts
    def encode_prompt(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt given as text, as chat messages (rendered by the chat template; a special-token
        string inside a message or tool is encoded as text, so only the template writes control tokens) or as ids.

        Raises: ValueError for an empty prompt, ids outside the vocabulary, or text without a tokenizer.
        """
        if isinstance(prompt, str):
            ids = self._tok().encode(prompt)
        elif len(prompt) and all(isinstance(m, Mapping) for m in prompt):
            if self.chat_template is None:
                raise ValueError("this checkpoint has no chat template; send text or token ids")
            tok = self._tok()  # control tokens only where the template writes them (chat.render_segments)
            messages: list[Mapping[str, Any]] = list(prompt)  # type: ignore[arg-type]
            segments = render_segments(self.chat_template, messages, tok.special_token_strings(), tools=tools,
                                       **dict(chat_template_kwargs or {}))
            ids = [t for text, user in segments for t in (tok.encode_as_text(text) if user else tok.encode(text))]
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
                 constraint: Constraint | None = None, cache_salt: str | None = None,
                 images: Sequence[PreparedImage] | None = None) -> Iterator[GenerationChunk]:
        """Generate from ``prompt``, yielding a chunk per round (the last one carries finish_reason).

        Images: chat messages may hold image parts (tandem/multimodal.py), read by a model with a vision tower; or
        ``images`` gives the prepared images of a token prompt whose pads are already expanded (the server's path).

        ``cancelled`` is polled once a round and between prefill pieces (a True ends generation with finish_reason
        "abort"); ``constraint`` masks every position's logits (structured outputs, forced tool calls);
        ``cache_salt`` keeps the request's cache entries apart from those of other salts.

        Raises:
            ValueError: invalid params or prompt. PromptTooLongError: the prompt fills the context.
        """
        params = (params or SamplingParams()).validate()
        if images is None:
            ids, images = self.encode_prompt_images(prompt, tools, chat_template_kwargs)
        else:
            ids = self.encode_prompt(prompt, tools, chat_template_kwargs)
        return self._run(ids, params, cancelled, constraint, cache_salt, images)

    def encode_prompt_images(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None,
                             chat_template_kwargs: Mapping[str, Any] | None = None
                             ) -> tuple[list[int], list[PreparedImage]]:
        """``encode_prompt``, with each image part of chat messages decoded and prepared and its pad expanded to
        its feature count; an http(s) image URL is fetched here by ``image_fetcher`` (refused without one).
        Returns: (ids, images in prompt order). Raises: ValueError (ImageError: a bad image, a failed fetch, or a
        model that reads none, in one line)."""
        return encode_with_images(self.encode_prompt, self.model, prompt, self.image_limits, tools,
                                  chat_template_kwargs, fetcher=self.image_fetcher)

    def _run(self, ids: list[int], params: SamplingParams, cancelled: Callable[[], bool] | None,
             constraint: Constraint | None = None, cache_salt: str | None = None,
             images: Sequence[PreparedImage] = ()) -> Iterator[GenerationChunk]:
        if len(ids) >= self.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_context} (prompt + output)")
        seed = params.resolved_seed()
        stop_ids = set() if params.ignore_eos else set(
            params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
        budget = min(params.max_tokens, self.max_context - len(ids))
        if images:
            image_spec_of(self.model)  # a model that reads no images: one line now, not in the slot
        return self._run_in_slot(ids, params, cancelled, constraint, cache_salt, seed, stop_ids, budget, images)

    def _run_in_slot(self, ids: list[int], params: SamplingParams, cancelled: Callable[[], bool] | None,
                     constraint: Constraint | None, cache_salt: str | None, seed: int, stop_ids: set[int],
                     budget: int, images: Sequence[PreparedImage] = ()) -> Iterator[GenerationChunk]:
        """The generation in a slot, held from the first chunk asked for until the generator ends or is closed."""
        slot = self.slots.acquire()
        self._local.slot = slot.index
        try:
            state = self._take_state(slot, len(ids) + budget)
            key = attach_images(self.model, state, ids, images) if images else None  # the vision tower runs here
            seq = SequenceCache(slot.model, self.cache, self.prefix_chunk, cache_salt or "", cancelled, key)
            self.last_cached_tokens = 0
            self._local.cache_tier = ""
            tokens = list(ids)
            clean = False
            if self.cache is not None:
                self.cache.begin(seq.salt)
            try:
                for chunk in self._generate(slot, ids, params, cancelled, constraint, state, seed, stop_ids, budget,
                                            seq):
                    tokens += chunk.token_ids
                    self.last_cached_tokens = seq.cached_tokens
                    self._local.cache_tier = seq.cached_tier
                    yield chunk
                clean = True
            except GeneratorExit:  # the consumer stopped between rounds: the state is whole
                clean = True
                raise
            finally:
                try:
                    if clean:
                        seq.finish(state, tokens)
                finally:
                    if self.cache is not None:
                        self.cache.end()
                    self._keep_state(slot, state)
        finally:
            if self.rounds is not None:
                self.rounds.leave(slot.index)
            self.slots.release(slot)

    def warm_up(self) -> float:
        """Compile and load the device kernels a request runs, so that the first request does not wait for them.

        CuPy compiles a CUDA module at its first launch (a minute and more for the whole engine on a fresh machine)
        and keeps the binary in its on-disk kernel cache, so a later process only loads it. This runs, with the
        prefix cache bypassed (nothing is looked up, published or counted): a greedy request of a 131-token prompt
        (two 64-token prefill pieces and a 3-token one, a repeated pattern so that a lookup drafter drafts) and 8
        output tokens, then a seeded sampled one (temperature 0.8, top-p 0.9), each through the engine's
        speculator when it has one. A host model (no ``capabilities.synchronize``: the NumPy engine) has nothing to
        compile and returns at once. Returns: the seconds spent (0.0 for a host model).
        """
        if not self.model.capabilities.synchronize:
            return 0.0
        t0 = time.perf_counter()
        if self.model.capabilities.reuses_states:  # every slot's state now, so later allocations see them taken
            held = [self.slots.acquire() for _ in range(self.slots.size)]
            try:
                for slot in held:
                    if slot.spare is None:
                        slot.spare = slot.model.new_state(self.max_context)
            finally:
                for slot in held:
                    self.slots.release(slot)
        period = min(self.vocab_size, 41)
        ids = [(7 * i + 3) % period for i in range(131)]
        cache, self.cache = self.cache, None
        try:
            for params in (SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=0)):
                for _ in self._run(ids, params.validate(), None):
                    pass
        finally:
            self.cache = cache
            self.last_cached_tokens = 0
            self.last_stats = GenerationStats()
        return time.perf_counter() - t0

    def _take_state(self, slot: Slot, max_len: int) -> Any:
        """A state for a sequence of at most ``max_len`` tokens: the slot's kept one when it is large enough (reset
        in place, its launch plans still recorded), else a new one: of ``max_context`` tokens for a model that reuses
        its states (``reuses_states``: the CUDA model), so that every later sequence fits it, else of ``max_len``."""
        spare, slot.spare = slot.spare, None
        if spare is not None and spare.max_len >= max_len:
            spare.reset()
            return spare
        spare = None  # too small: let it go before the new one is allocated
        if self.model.capabilities.reuses_states:
            max_len = max(max_len, self.max_context)
        return slot.model.new_state(max_len)

    def release_state(self) -> None:
        """Let go of the device states kept by the idle slots from their last sequences (each: its KV cache and
        launch plans, at 27B about 4.3 GB of fp32 KV for a 32k-token sequence, plus up to ~236 MB of verify plans);
        their next sequences allocate and record anew. Idle memory only: a running sequence keeps its own state."""
        for slot in self.slots.built():
            slot.spare = None
        release = getattr(self.model, "release_joint_plans", None)  # joint plans hold the states they ran
        if release is not None:
            release()

    def _keep_state(self, slot: Slot, state: Any) -> None:
        """Keep an ended sequence's state in its slot for the slot's next one, for a model that reuses its states
        (``reuses_states``: every such state holds ``max_context`` tokens). Host states are not kept: they record no
        plans, and a fresh zeroed array costs nothing until written."""
        if self.model.capabilities.reuses_states:
            slot.spare = state

    def _generate(self, slot: Slot, ids: list[int], params: SamplingParams, cancelled: Callable[[], bool] | None,
                  constraint: Constraint | None, state: Any, seed: int, stop_ids: set[int], budget: int,
                  seq: SequenceCache) -> Iterator[GenerationChunk]:
        penalties = PenaltyState.from_params(params, self.vocab_size, ids)
        stops = StopMatcher(params.stop)
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        self.last_stats = stats = GenerationStats()
        out = Output(params, stop_ids, stops, detok, budget)
        spec = self._speculator(slot)
        if spec is not None:
            try:
                yield from speculative_rounds(PrefillModel(spec.model, seq), spec, ids, state,
                                              params, seed, penalties, out, stats, cancelled, constraint, self._sync)
            except PrefillCancelled:
                yield out.chunk(out.abort(), None)
            return
        pen = penalties if penalties.active else None
        try:
            logits = seq.prefill(state, ids)
        except PrefillCancelled:
            yield out.chunk(out.abort(), None)
            return
        if self.run_ahead and constraint is None and params.logprobs is None \
                and self.model.capabilities.device_sampling and not isinstance(logits, np.ndarray):
            yield from self._run_ahead(slot.model, logits, state, params, seed, pen, out, stats, budget, cancelled)
            return
        round_stats: RoundStats | None = None
        while True:  # plain rounds: one decode step each
            token = constraint_choose(logits, constraint, params, pen, seed, state.length)
            penalties.add(token)
            finish = out.push_polled(token, logits, cancelled)
            yield out.chunk(finish, round_stats)
            if finish is not None:
                return
            t0 = time.perf_counter()
            logits = slot.model.decode(state, token)
            self._sync()
            round_stats = RoundStats(1, 1, verify_ms=(time.perf_counter() - t0) * 1e3)
            stats.rounds.append(round_stats)

    def _run_ahead(self, model: Any, logits: Any, state: Any, params: SamplingParams, seed: int, pen: PenaltyState | None,
                   out: Output, stats: GenerationStats, budget: int, cancelled: Callable[[], bool] | None
                   ) -> Iterator[GenerationChunk]:
        """Plain rounds on a device model without masks or logprobs, one step ahead: each id is chosen on the
        device (``model.choose_on_device``: the argmax, or the sampler at (seed, position) as ``choose.device_choose``,
        after the penalties ``pen``, whose counts the device keeps from here on) and the step that consumes it is
        queued before the host reads it, so the GPU does not wait for the host's id read, detokenizing and launches
        between steps. The tokens are the plain loop's (the same kernels and bits; tests/test_cuda_engine.py). The
        step queued after the last token (an eos or a stop string: the budget's end is known and never run past) is
        discarded: its id is never read, and the state is reset before it is used again (``_take_state``).
        A round's ``verify_ms`` is the host time between two ids' arrivals (one step, once the loop is going).
        Raises: ValueError when the sampler finds no token left (as choose_token).
        """
        sampler = device_sampler(model)
        assert sampler is not None  # _generate runs ahead only on a model with device_sampling
        pending = sampler.choose_on_device(state, logits, params, seed, state.length, pen)
        round_stats: RoundStats | None = None
        last = 0.0  # when the previous id arrived
        while True:
            follow = None
            if out.count + 1 < budget:  # the id being read is not the budget's last: queue its step first
                following = model.decode(state, pending)
                follow = sampler.choose_on_device(state, following, params, seed, state.length, pen)
            token = checked_id(pending.get())
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

    def complete(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Completion:
        """Run ``generate`` to the end and collect ids, text, finish reason and timing."""
        params = (params or SamplingParams()).validate()
        images = kwargs.get("images")
        if images is None:
            ids, images = self.encode_prompt_images(prompt, kwargs.get("tools"), kwargs.get("chat_template_kwargs"))
        else:
            ids = self.encode_prompt(prompt, kwargs.get("tools"), kwargs.get("chat_template_kwargs"))
        t0 = time.perf_counter()
        first: float | None = None
        out: list[int] = []
        texts: list[str] = []
        lps: list[TokenLogprob] = []
        finish = "length"
        for chunk in self._run(ids, params, kwargs.get("cancelled"), kwargs.get("constraint"),
                               kwargs.get("cache_salt"), images):
            first = first if first is not None else time.perf_counter()
            out += chunk.token_ids
            texts.append(chunk.text)
            lps += chunk.logprobs
            finish = chunk.finish_reason or finish
        t1 = time.perf_counter()
        first = first if first is not None else t1
        return Completion(ids, out, "".join(texts), finish, first - t0, t1 - first, lps, self.last_stats)



JOINT_TREE_ROWS = 32  # the rows the slots' trees share in a joint round (the verify GEMVs' 32 rows)
DEFAULT_PREFIX_CHUNK = 256  # the CPU's grid: a snapshot of the embedded model (~0.8 MB) per 256 tokens


def check_prefix_chunk(chunk: int) -> int:
    """``chunk`` when it is a positive multiple of the adapters' prefill piece (64). Raises: ValueError."""
    if chunk < PREFILL_CHUNK or chunk % PREFILL_CHUNK:
        raise ValueError(f"prefix_chunk must be a positive multiple of {PREFILL_CHUNK} tokens, got {chunk}")
    return int(chunk)


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


def _progress_bar(raw: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    from tandem.progress import progress

    return progress(int(raw.text.get("num_hidden_layers", 0)), "loading layers", "layer")
