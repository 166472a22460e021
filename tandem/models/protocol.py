"""The contract between a model adapter and the methods above it (the engine, the speculator, the server).

A model is any object with the members of ``Model``: its hyper-parameters ``hp`` (``HParams``), its declared
``capabilities`` and the verbs ``new_state``, ``prefill`` and ``decode``. What it can do beyond that is declared in
``capabilities`` (a ``Capabilities``), never probed: each optional capability has its own Protocol naming the members
it brings, and the accessors below (``tree_verifier``, ``draft_head_source``, ``device_sampler``, ``plan_recorder``,
``synchronizer``, ``placeable``) give the model as that Protocol where it declares the capability, else None. The
adapter class itself offers the cold verb ``load(path, progress)`` (``Adapter``), which the registry returns.

A sequence's state (``SequenceState``: tandem/models/state.py ``ModelState`` on the host, device_state.py
``DeviceState`` on a GPU) is what ``new_state`` returns and every verb takes: ``length`` committed tokens of at most
``max_len``; ``reset`` and ``copy_from`` work in place.

The Qwen3.5 adapters are checked against these Protocols by mypy (the ``if TYPE_CHECKING`` blocks at the end of
tandem/models/qwen3_5/model.py and cuda_model.py); tests/toy_arch.py is a made-up architecture served through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

StateT = TypeVar("StateT")
StateT_contra = TypeVar("StateT_contra", contravariant=True)
ScratchT = TypeVar("ScratchT")


class HParams(Protocol):
    """The hyper-parameters the engine reads: vocabulary size V, the longest position, the default stop ids."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...


class SequenceState(Protocol):
    """One sequence's state: ``length`` committed tokens (positions 0..length-1), room for ``max_len``."""

    length: int
    max_len: int

    def reset(self) -> None:
        """Zero every buffer in place and set ``length`` to 0."""
        ...

    def copy_from(self, other: Any) -> None:
        """Copy another state of the same model into this one, in place (ValueError for another model's)."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What a model can do beyond ``Model``'s verbs, declared (the engine and speculator never probe for members).

    Attributes:
        tree_verify: the ``TreeVerifier`` verbs (speculation: ``new_tree_scratch``, ``verify_tree``, ``commit``).
        draft_heads: ``DraftHeadSource.draft_heads`` (the checkpoint's MTP head, or None when it has none), and
            ``prefill`` / ``decode`` fill ``hidden_out`` (the post-final-norm hidden states the head reads).
        device_sampling: ``DeviceSampler.choose_on_device`` (logits stay on the device, only ids cross).
        plan_recordings: ``PlanRecorder.plan_recordings`` (launch plans recorded so far; a round that recorded one
            is left out of the prices).
        synchronize: ``Synchronizer.synchronize`` (the verbs return before the device's work is done).
        devices: the devices ``Placeable.on_device`` moves the model to; () when it runs only where it is.
        reuses_states: the engine allocates the model's states at its context size and reuses one across sequences
            (reset in place), because a state carries recorded launch plans.
        verify_sizes: the tree sizes the model keeps recorded verify plans for (the speculator prefers them); ().
        profile_device: the price-profile key of the model's device (profiles/<key>.json), or None for this CPU's.
        prefill_matches_decode: ``prefill`` of a token sequence gives the state (every buffer) and logits that
            ``decode`` of the same tokens one by one gives, bit for bit, so a state taken after decode steps equals
            a cold prefill of its tokens (the prefix cache keeps session snapshots at any length only then).
        prefill_chunk_invariant: the state and logits after prefilling t[0:n] depend on those tokens alone, not on
            how they were split into calls (so a state prefilled to any length, a prompt's end included, continues
            as a one-pass prefill would): the prefix cache keeps a snapshot at each prompt's end only then.
        prefill_grid: the positions a prefill may be cut at without changing its bits, when that is not any position:
            a model whose kernels run chunks on the absolute position grid (the chunked GDN scan: 64) is
            chunk-invariant only for calls that start on a multiple of it, cut at multiples of it; the prefix cache
            then keeps a prompt's end snapshot at the last multiple at or before the end (the next turn prefills
            the rest again). 0 or 1: any position.
        expert_routing: (experts X, chosen k, share s) for a model whose rows each read k of X routed experts' weights
            (a sparse MoE): a verify of N rows reads the distinct experts its rows chose once, so its price is the
            dense curve's plus s · (distinct(N) / k − 1) of a step (StairCut, ``PriceCurve.with_routing``); s is the
            routed experts' share of a decode step's weight bytes. None: every row reads the same weights.
        kv_dtypes: the KV-row storages ``KVStorage.kv_dtype`` may be set to ("float32", "bfloat16"); () when the
            model has no choice.
        joint_rounds: ``JointForward.joint_forward`` (several sequences' decode steps and verify passes in one
            forward pass, every row with the bits it has alone): the engine's slots (tandem/slots.py) gather their
            rounds into one pass.
        vision: ``VisionModel`` (images in: ``image_spec`` and ``image_rows``; the rows go on the sequence's state
            as ``state.multimodal`` before its prefill). False: the engine refuses images with one line.
    """

    tree_verify: bool = False
    draft_heads: bool = False
    device_sampling: bool = False
    plan_recordings: bool = False
    synchronize: bool = False
    devices: tuple[str, ...] = ()
    reuses_states: bool = False
    verify_sizes: tuple[int, ...] = ()
    profile_device: str | None = None
    prefill_matches_decode: bool = False
    prefill_chunk_invariant: bool = False
    prefill_grid: int = 0
    expert_routing: tuple[int, int, float] | None = None
    kv_dtypes: tuple[str, ...] = ()
    joint_rounds: bool = False
    vision: bool = False


class Model(Protocol[StateT]):
    """The verbs every adapter has. Hot: ``prefill``, ``decode``. Cold: ``new_state``.

    Logits are float32 [V] (or [N, V]): a NumPy array on the host, a device array on a GPU. ``hidden_out`` is
    passed only to a model whose ``capabilities.draft_heads`` is set (the MTP drafter needs hidden states).
    """

    @property
    def hp(self) -> HParams: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def new_state(self, max_len: int) -> StateT:
        """A zeroed state for a sequence of at most ``max_len`` tokens."""
        ...

    def prefill(self, state: StateT, ids: Sequence[int], *, hidden_out: list[Any] | None = None) -> Any:
        """Run ``ids`` at positions state.length.. and append them; the last token's logits [V].
        Raises: ValueError for no ids, an id outside the vocabulary or a full state."""
        ...

    def decode(self, state: StateT, token: Any, *, hidden_out: list[Any] | None = None) -> Any:
        """One token at position state.length; its logits [V]. Raises: ValueError on a bad id or a full state."""
        ...


class TreeVerifier(Protocol[StateT_contra, ScratchT]):
    """``capabilities.tree_verify``: verify a draft tree in one pass and commit its accepted path."""

    def new_tree_scratch(self, max_nodes: int) -> ScratchT:
        """Per-sequence verify/commit buffers for trees of at most ``max_nodes`` nodes (``hidden`` [N, E]: the
        verified nodes' hidden states, for a model with draft heads)."""
        ...

    def verify_tree(self, state: StateT_contra, scratch: ScratchT, token_ids: Sequence[int],
                    parent_ids: Sequence[int]) -> Any:
        """Logits [N, V] of every node of a tree after the committed tokens (node 0 the pending root, parent -1;
        parent_ids[i] < i); row i has the bits of a plain decode of node i after its path. Only the state's
        scratch rows (past ``length``) are written. Raises: ValueError on a malformed or oversized tree."""
        ...

    def commit(self, state: StateT_contra, scratch: ScratchT, path: Sequence[int]) -> None:
        """Append the accepted root-to-node ``path`` of the last verify, with the bits of decoding it token by
        token. Raises: ValueError for a bad path or a state moved since the verify."""
        ...


class SpeculativeModel(Model[StateT], TreeVerifier[StateT, ScratchT], Protocol[StateT, ScratchT]):
    """A model with ``capabilities.tree_verify``: what the speculative loop (tandem/speculative/rounds.py) calls."""


@dataclass
class JointItem:
    """One sequence's part of a joint forward pass (``JointForward.joint_forward``).

    A decode step (``parent_ids`` None): ``token_ids`` holds the one token (an id, or a device sampler's pending
    id) at position state.length, which the pass appends, as ``decode``. A verify (``parent_ids`` given): the draft
    tree ``token_ids`` / ``parent_ids`` over ``scratch``, as ``verify_tree`` (the state's length does not move).
    ``hidden_out``: as the verbs' (a decode's post-final-norm hidden [1, E] is appended; a verify's stay in the
    scratch).
    """

    state: Any
    token_ids: Sequence[Any]
    parent_ids: Sequence[int] | None = None
    scratch: Any = None
    hidden_out: list[Any] | None = None


class JointForward(Protocol):
    """``capabilities.joint_rounds``: several sequences' decode steps and verify passes in one forward pass."""

    def joint_forward(self, items: Sequence[JointItem]) -> list[Any]:
        """Each item's result, in order: a decode's logits [V], a verify's logits [N, V], each bit for bit what
        ``decode`` / ``verify_tree`` returns for that item alone, or the ValueError that call would raise (the
        other items still run). The matrix rows of every item go through each weight together; attention, the
        recurrent update and the state writes are each item's own."""
        ...


class DraftHeadSource(Protocol):
    """``capabilities.draft_heads``: the checkpoint's own drafter (tandem/speculative/mtp_drafter.py ``DraftHead``)."""

    def draft_heads(self) -> Any:
        """The MTP head, loaded on first use; None when the checkpoint has none."""
        ...


class DraftHead(Protocol):
    """A model's own drafter (``DraftHeadSource.draft_heads``), as tandem/speculative/mtp_drafter.py drives it.

    ``max_top_k``: the most ids ``top_probs`` returns (None: any k). ``chains``: the head has ``chain``
    (``ChainingDraftHead``), a whole draft chain in one call with one host read.
    """

    @property
    def max_top_k(self) -> int | None: ...

    @property
    def chains(self) -> bool: ...

    def new_state(self, max_len: int) -> Any:
        """The head's own cache for ``max_len`` rows (``length``, ``max_len``)."""
        ...

    def forward(self, state: Any, token_ids: list[int], hidden: Any, start: int) -> Any:
        """The head's output hidden states [T, E] of rows start..start+T-1 (row t: token_{t+1} and h_t)."""
        ...

    def top_probs(self, hidden: Any, k: int) -> tuple[Any, Any]:
        """The k best next ids after the last row of ``hidden`` and their probabilities (best first)."""
        ...


class ChainingDraftHead(DraftHead, Protocol):
    """A ``DraftHead`` whose ``chains`` is set."""

    def chain(self, state: Any, root: int, hidden: Any, start: int, steps: int, k: int) -> tuple[Any, Any] | None:
        """``steps`` rows from ``root`` at ``start``, each fed the previous row's best id: (ids [steps, k], probs
        [steps, k]), or None when it cannot run them."""
        ...


class DeviceSampler(Protocol[StateT_contra]):
    """``capabilities.device_sampling``: choose the next id on the device from device logits."""

    def choose_on_device(self, state: StateT_contra, logits: Any, params: Any = None, seed: int = 0, position: int = 0,
                         penalties: Any = None) -> Any:
        """A pending id (``get()`` reads it on the host; -1: no token left), which ``decode`` also takes."""
        ...


class PlanRecorder(Protocol):
    """``capabilities.plan_recordings``: a count of the launch plans recorded so far in this process."""

    @property
    def plan_recordings(self) -> int: ...


class Synchronizer(Protocol):
    """``capabilities.synchronize``: wait for the device's queued work (the verbs return before it is done)."""

    def synchronize(self) -> None: ...


class DeviceLimitError(ValueError):
    """The device's kernels cannot serve a dimension of the model; the message is one line naming it (a config
    field, its value and the limit). ``Placeable.on_device`` raises it before anything reaches the device."""


class Placeable(Protocol):
    """``capabilities.devices``: the model on another device ("cpu": itself)."""

    def on_device(self, device: str) -> Any:
        """The model on ``device`` (one of ``capabilities.devices``). Raises: DeviceLimitError when that device's
        kernels cannot serve one of the model's dimensions; ValueError for another name."""
        ...


class KVStorage(Protocol):
    """``capabilities.kv_dtypes``: the KV rows' storage, set before the model is placed or states are made."""

    kv_dtype: str


def kv_storage(model: Model[Any]) -> KVStorage | None:
    """The model as a ``KVStorage`` where it declares ``kv_dtypes``, else None."""
    return cast(KVStorage, model) if model.capabilities.kv_dtypes else None


class Adapter(Protocol):
    """An adapter class, as the registry returns it: ``load`` builds a model from a checkpoint directory."""

    def load(self, path: str | Path, progress: Callable[[int], None] | None = None) -> Any:
        """Load config and weights. Raises: ConfigError / CheckpointError for a bad checkpoint."""
        ...


class VisionModel(Protocol):
    """An adapter that reads images (``Capabilities.vision``; tandem/multimodal.py drives it)."""

    def image_spec(self) -> Any:
        """The checkpoint's image preprocessing (tandem/images.py ``ImageSpec``) and vision token ids as
        ``(spec, image_token_id)``, or None when the checkpoint has no vision tower or vision is off."""
        ...

    def set_vision_mode(self, mode: str) -> None:
        """"auto" (load the tower at the first image), "on" (now), "off" (``image_spec`` None). Raises: ValueError
        ("on" without a tower), CheckpointError."""
        ...

    def image_rows(self, ids: Sequence[int], images: Sequence[Any]) -> Any:
        """The per-sequence rows of a prompt whose ``images`` (``PreparedImage``) fill its expanded pad runs:
        positions and vision features, to set as ``state.multimodal``. Raises: ValueError."""
        ...


def vision_model(model: Model[Any]) -> VisionModel | None:
    """The model typed as a ``VisionModel`` when it declares ``capabilities.vision``, else None."""
    return cast(VisionModel, model) if model.capabilities.vision else None


def tensor_parallel_layout(adapter: Adapter) -> str | None:
    """The tensor-parallel layout an adapter class declares (its ``tensor_parallel_layout``: a name
    tandem/parallel/load.py builds a mesh for, e.g. "qwen3_5"), or None when it declares none."""
    layout = getattr(adapter, "tensor_parallel_layout", None)
    return layout if isinstance(layout, str) else None


def run_items_alone(model: Any, items: Sequence[JointItem]) -> list[Any]:
    """``joint_forward``'s results for a model without the joint pass (or without its fast kernels): each item
    through its own verb (``decode`` / ``verify_tree``), one after the other; the ValueError a verb raises is the
    item's result."""
    out: list[Any] = []
    for it in items:
        try:
            if it.parent_ids is None:
                kw = {"hidden_out": it.hidden_out} if it.hidden_out is not None else {}
                out.append(model.decode(it.state, it.token_ids[0], **kw))
            else:
                out.append(model.verify_tree(it.state, it.scratch, it.token_ids, it.parent_ids))
        except ValueError as exc:
            out.append(exc)
    return out


def joint_forward(model: Model[Any]) -> JointForward | None:
    """The model as a ``JointForward`` where it declares ``joint_rounds``, else None."""
    return cast(JointForward, model) if model.capabilities.joint_rounds else None


def tree_verifier(model: Model[Any]) -> SpeculativeModel[Any, Any] | None:
    """The model as a ``SpeculativeModel`` where it declares ``tree_verify``, else None."""
    return cast("SpeculativeModel[Any, Any]", model) if model.capabilities.tree_verify else None


def draft_head_source(model: Model[Any]) -> DraftHeadSource | None:
    """The model as a ``DraftHeadSource`` where it declares ``draft_heads``, else None."""
    return cast(DraftHeadSource, model) if model.capabilities.draft_heads else None


def device_sampler(model: Model[Any]) -> DeviceSampler[Any] | None:
    """The model as a ``DeviceSampler`` where it declares ``device_sampling``, else None."""
    return cast("DeviceSampler[Any]", model) if model.capabilities.device_sampling else None


def plan_recordings(model: Model[Any]) -> int:
    """The model's launch-plan recordings so far; 0 for a model that records none."""
    return cast(PlanRecorder, model).plan_recordings if model.capabilities.plan_recordings else 0


def synchronizer(model: Model[Any]) -> Callable[[], None]:
    """The model's ``synchronize``, or a no-op for a model whose verbs return when their work is done."""
    return cast(Synchronizer, model).synchronize if model.capabilities.synchronize else _no_sync


def placeable(model: Model[Any], device: str) -> Placeable | None:
    """The model as a ``Placeable`` where it declares ``device`` among its ``devices``, else None."""
    return cast(Placeable, model) if device in model.capabilities.devices else None


def _no_sync() -> None:
    """A host model's synchronize: its verbs return when their work is done."""
