"""The Qwen3.5 dense text model on the NumPy reference backend: hparams → tensors → layer loop.

Implements spec/qwen3_5.md §4 (Gated DeltaNet), §5 (gated attention), §6 (decoder block, head) in fp32 with an
fp32 residual stream (DESIGN.md, "Exactness" layer 1). Hot verbs: ``prefill`` (pieces of up to 64 tokens) and
``decode`` (one token). Both run every token with decode's arithmetic, so prefill is row-invariant with decode
(``Capabilities.prefill_matches_decode``): the projections go through ``Linear.matmul`` (one GEMV a row,
tandem/formats/linear.py), norms, gates, the conv and RoPE act on each row alone, the delta rule is the recurrent
``ops.gdn_rows`` (``ops.gdn_step``'s arithmetic token by token) and attention is ``ops.attention_rows`` (each row
over the rows before it). A prompt prefilled in one pass, in pieces of any size or token by token by decode leaves
the same state bits and gives the same logits (tests/test_prefill_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tandem.backend import numpy_ops as ops
from tandem.backend.kv_rows import read_rows, write_rows
from tandem.checkpoint import Checkpoint
from tandem.config import RawConfig, read_config
from tandem.dtypes import KV_DTYPES
from tandem.formats import DenseLinear, Linear
from tandem.models.qwen3_5 import verify as _verify
from tandem.models.qwen3_5.host import MatMul
from tandem.models.qwen3_5.hparams import FULL, HParams
from tandem.models.qwen3_5.mrope import MultimodalRows, mrope_tables, multimodal_rows, read_mrope_section
from tandem.models.qwen3_5.vision import VisionSide
from tandem.models.qwen3_5.state_layout import check_ids, state_specs
from tandem.models.protocol import Capabilities, DeviceLimitError
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights, LayerWeights, ModelWeights, load_weights
from tandem.models.state import BufferSpec, ModelState

F32 = np.float32


_mm_rows = _verify.decode_matmul  # prefill, decode and verify share one row-invariant matmul


class PieceModel(Protocol):
    """What ``prefill_pieces`` and ``decode_token`` drive: the id check, the layer loop over positions
    start..start+T-1 (hidden [T, E] before the final norm), the final norm and the head (Qwen3_5Model; the
    tensor-parallel mesh, tandem/parallel/numpy_mesh.py)."""

    def _check_ids(self, state: Any, ids: Sequence[int]) -> None: ...

    def _forward(self, state: Any, ids: Sequence[int], start: int, mm: MatMul) -> np.ndarray: ...

    def _normed(self, x: np.ndarray) -> np.ndarray: ...

    def _head(self, h: np.ndarray, mm: MatMul) -> np.ndarray: ...


def prefill_pieces(model: PieceModel, state: Any, ids: Sequence[int], all_logits: bool,
                   hidden_out: list[np.ndarray] | None) -> np.ndarray:
    """``prefill``: ``ids`` at positions state.length.. in pieces ending at absolute multiples of ``ops.GDN_CHUNK``,
    every token with decode's arithmetic. Returns logits [V] float32 of the last token ([T, V] with ``all_logits``);
    appends the post-final-norm hidden [T, E] of every piece to ``hidden_out`` when given. Raises: ValueError (the
    model's id check)."""
    model._check_ids(state, ids)
    outs = []
    base = pos = state.length
    end = base + len(ids)
    while pos < end:
        stop = min(end, (pos // ops.GDN_CHUNK + 1) * ops.GDN_CHUNK)
        x = model._forward(state, ids[pos - base:stop - base], pos, _mm_rows)
        outs.append(model._head(model._normed(x), _mm_rows) if all_logits else x[-1:])
        if hidden_out is not None:
            hidden_out.append(model._normed(x))
        pos = stop
    state.length = end
    if all_logits:
        return np.concatenate(outs)
    return np.asarray(model._head(model._normed(outs[-1]), _mm_rows)[0])


def decode_token(model: PieceModel, state: Any, token: int, hidden_out: list[np.ndarray] | None) -> np.ndarray:
    """``decode``: one token at position state.length. Returns logits [V] float32; appends its post-final-norm
    hidden [1, E] to ``hidden_out`` when given. Raises: ValueError (the model's id check)."""
    model._check_ids(state, [token])
    x = model._forward(state, [token], state.length, _mm_rows)
    state.length += 1
    normed = model._normed(x)
    if hidden_out is not None:
        hidden_out.append(normed)
    return np.asarray(model._head(normed, _mm_rows)[0])


class Qwen3_5Model:
    """Qwen3.5 dense text model (``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5ForCausalLM`` checkpoints).

    Attributes:
        hp: hyper-parameters. weights: fp32 weights and Linear objects. head: the output Linear [V, E].
        kv_dtype: the KV rows' storage, "float32" (the default) or "bfloat16" (rounded to nearest even when written,
            widened exactly when read: tandem/backend/kv_rows.py); set before states are made.
        capabilities: tree verify, the MTP head (``draft_heads``), and ``on_device`` to "cpu" or "cuda"
            (tandem/models/protocol.py).
    """

    capabilities = Capabilities(tree_verify=True, draft_heads=True, devices=("cpu", "cuda"),
                                prefill_matches_decode=True, kv_dtypes=KV_DTYPES, vision=True)
    kv_dtype = "float32"  # the KV views' storage ("float32" / "bfloat16"), read when a state or the GPU model is made
    # the split of tandem/parallel/plan.py (tandem/parallel/load.py builds the mesh); None: no tensor parallelism
    tensor_parallel_layout: str | None = "qwen3_5"

    def __init__(self, hp: HParams, weights: ModelWeights, raw: RawConfig | None = None) -> None:
        self.hp = hp
        self.weights = weights
        self.raw = raw
        self.head: Linear = weights.lm_head if weights.lm_head is not None else DenseLinear(weights.embed, "embed")
        self.path: Path | None = None  # the checkpoint directory (the MTP drafter loads ``mtp.*`` from it)
        self._draft_heads: Any = None
        self.vision = VisionSide(None, None, hp.hidden_size)  # images in (vision.py); set by ``load``
        # the rotary split of image prompts' 3-D positions (mrope.py); text-only prompts never read it
        self.mrope_section = read_mrope_section(raw.text) if raw is not None else (11, 11, 10)

    @classmethod
    def load(cls, path: str | Path, progress: Callable[[int], None] | None = None) -> "Qwen3_5Model":
        """Load config and text weights from a checkpoint directory.

        Raises: ConfigError (bad config.json), CheckpointError (missing/mis-shaped/truncated tensors).
        """
        raw = read_config(path)
        hp = HParams.from_config(raw)
        model = cls(hp, load_weights(Checkpoint.open(path), hp, progress), raw)
        model.path = Path(path)
        model.vision = VisionSide(model.path, raw, hp.hidden_size)
        return model

    def on_device(self, device: str) -> Any:
        """This model on ``device``: itself for "cpu"; for "cuda" a ``CudaQwen3_5Model`` (weights copied to the
        GPU once; tandem/models/qwen3_5/cuda_model.py).
        Raises: DeviceLimitError (before any upload) when a dimension is outside the CUDA kernels' limits
        (cuda_limits.py), naming it; ValueError for another device name."""
        if device == "cpu":
            return self
        if device == "cuda":
            from tandem.models.qwen3_5.cuda_limits import cuda_limit

            limit = cuda_limit(self.hp)
            if limit is not None:
                raise DeviceLimitError(limit)
            from tandem.models.qwen3_5.cuda_model import CudaQwen3_5Model

            return CudaQwen3_5Model(self)
        raise ValueError(f"unknown device {device!r} (expected 'cpu' or 'cuda')")

    # ----------------------------------------------------------------------------------------------- state
    def state_specs(self, max_len: int) -> list[BufferSpec]:
        """Buffers of one sequence (state_layout.state_specs): GDN ``conv``/``ssm`` sections (float32), attention
        ``k``/``v`` views of ``kv_dtype``."""
        return state_specs(self.hp, max_len, self.kv_dtype)

    def new_state(self, max_len: int) -> ModelState:
        """Allocate a zeroed state for a sequence of at most ``max_len`` tokens."""
        return ModelState(self.state_specs(max_len), max_len)

    # ----------------------------------------------------------------------------------------------- verbs
    def prefill(self, state: ModelState, ids: Sequence[int], all_logits: bool = False,
                hidden_out: list[np.ndarray] | None = None) -> np.ndarray:
        """Run ``ids`` at positions state.length.. and append them to the state.

        Pieces end at absolute multiples of ``ops.GDN_CHUNK`` (bounding the activations); every token gets
        decode's bits whatever the pieces, so the state and logits equal ``decode``'s of the same tokens.

        Returns: logits [V] float32 of the last token, or [T, V] with ``all_logits``. With ``hidden_out``, the
        post-final-norm hidden states [T, E] of every token are appended to it (the MTP drafter's input).
        Raises: ValueError if ids is empty, holds an id outside the vocabulary or overflows the state.
        """
        return prefill_pieces(self, state, ids, all_logits, hidden_out)

    def decode(self, state: ModelState, token: int, hidden_out: list[np.ndarray] | None = None) -> np.ndarray:
        """One token at position state.length (the arithmetic of every prefill row).

        Returns: logits [V] float32; with ``hidden_out``, its post-final-norm hidden state [1, E] is appended.
        Raises: ValueError on a bad id or a full state.
        """
        return decode_token(self, state, token, hidden_out)

    # Speculation verbs (tandem/models/qwen3_5/verify.py): bound methods, no wrappers.
    verify_tree = _verify.verify_tree
    commit = _verify.commit

    def new_tree_scratch(self, max_nodes: int) -> _verify.TreeScratch:
        """Per-sequence verify/commit buffers for trees of at most ``max_nodes`` nodes (allocated once)."""
        return _verify.TreeScratch(self.hp, max_nodes)

    def image_spec(self) -> Any:
        """(ImageSpec, image pad id) of the checkpoint's vision tower, or None (none, or ``--vision off``)."""
        return self.vision.spec()

    def set_vision_mode(self, mode: str) -> None:
        """``--vision``: "auto", "on" (load the tower now) or "off" (VisionSide.set_mode). Raises: ValueError,
        CheckpointError."""
        self.vision.set_mode(mode)

    def image_rows(self, ids: Sequence[int], images: Sequence[Any]) -> MultimodalRows:
        """The rows (3-D positions, vision features at the pads) of a prompt with its pads expanded, for
        ``state.multimodal`` (mrope.py). Raises: ValueError (pads and images disagree), CheckpointError."""
        return self.vision.rows(ids, images)

    def draft_heads(self) -> Any:
        """The checkpoint's MTP drafter head (``mtp.*``, spec §8), loaded on first use; None if absent."""
        if self._draft_heads is None and self.path is not None:
            from tandem.models.qwen3_5.mtp import load_mtp

            self._draft_heads = load_mtp(self) or False
        return self._draft_heads or None

    # ----------------------------------------------------------------------------------------------- layers
    def _check_ids(self, state: ModelState, ids: Sequence[int]) -> None:
        check_ids(self.hp, state, ids)

    def _forward(self, state: ModelState, ids: Sequence[int], start: int, mm: MatMul) -> np.ndarray:
        """Hidden states [T, E] (before the final norm) of tokens at positions start..start+T-1."""
        x = self.weights.embed[np.asarray(ids, dtype=np.int64)].astype(F32)
        rows = multimodal_rows(state)
        if rows is not None:  # an image prompt: its pads take the vision features
            rows.place(x, start)
        for i, lw in enumerate(self.weights.layers):
            h = ops.rms_norm(x, lw.input_norm, self.hp.rms_norm_eps)
            if lw.kind == FULL:
                assert isinstance(lw.mixer, AttnWeights)
                x = x + self._attention(lw.mixer, h, state, i, start, mm)
            else:
                assert isinstance(lw.mixer, GDNWeights)
                x = x + self._gdn(lw.mixer, h, state, i, mm)
            x = x + self._mlp(lw, ops.rms_norm(x, lw.post_norm, self.hp.rms_norm_eps), mm)
        return x

    def _normed(self, x: np.ndarray) -> np.ndarray:
        """The final RMSNorm of hidden states [T, E]."""
        return ops.rms_norm(x, self.weights.norm, self.hp.rms_norm_eps)

    def _head(self, h: np.ndarray, mm: MatMul) -> np.ndarray:
        """Logits [T, V] of post-final-norm hidden states h [T, E]."""
        return mm(self.head, h)

    def _logits(self, x: np.ndarray, mm: MatMul) -> np.ndarray:
        return self._head(self._normed(x), mm)

    @staticmethod
    def _mlp(lw: LayerWeights, h: np.ndarray, mm: MatMul) -> np.ndarray:
        return mm(lw.mlp.down, ops.silu(mm(lw.mlp.gate, h)) * mm(lw.mlp.up, h))

    def gdn_inputs(self, w: GDNWeights, h: np.ndarray, tail: np.ndarray, mm: MatMul
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Projections, causal conv and gates of T tokens after the conv ``tail`` [K-1, conv_dim].

        Returns: q, k [T, Hv, dk] (L2-normed; q scaled by dk^-1/2; expanded to v-heads), v [T, Hv, dv],
        g, beta [T, Hv], z [T, Hv, dv], window [K-1+T, conv_dim] (pre-conv rows; its last K-1 rows are the
        new tail).
        """
        hp = self.hp
        t = h.shape[0]
        window = np.concatenate([tail, mm(w.in_qkv, h)])
        u = ops.causal_conv(window, w.conv)
        kd, r = hp.key_dim, hp.linear_num_value_heads // hp.linear_num_key_heads
        q = ops.l2norm(u[:, :kd].reshape(t, hp.linear_num_key_heads, hp.linear_key_head_dim))
        q = (q * F32(1.0 / np.sqrt(hp.linear_key_head_dim))).astype(F32)
        k = ops.l2norm(u[:, kd:2 * kd].reshape(t, hp.linear_num_key_heads, hp.linear_key_head_dim))
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # v-head j uses k-head j // r
        v = u[:, 2 * kd:].reshape(t, hp.linear_num_value_heads, hp.linear_value_head_dim)
        g, beta = ops.gdn_gates(mm(w.in_a, h), mm(w.in_b, h), w.a_log, w.dt_bias)
        z = mm(w.in_z, h).reshape(t, hp.linear_num_value_heads, hp.linear_value_head_dim)
        return q, k, v, g, beta, z, window

    def gdn_output(self, w: GDNWeights, o: np.ndarray, z: np.ndarray, mm: MatMul) -> np.ndarray:
        """Gated RMSNorm of o [T, Hv, dv] with z, then out_proj → [T, E]."""
        y = ops.gated_rms_norm(o, z, w.norm, self.hp.rms_norm_eps)
        return mm(w.out, y.reshape(o.shape[0], -1))

    def _gdn(self, w: GDNWeights, h: np.ndarray, state: ModelState, i: int, mm: MatMul) -> np.ndarray:
        tail = state.buffers[f"layers.{i}.conv"]
        ssm = state.buffers[f"layers.{i}.ssm"]
        q, k, v, g, beta, z, window = self.gdn_inputs(w, h, tail, mm)
        tail[...] = window[window.shape[0] - tail.shape[0]:]
        o = ops.gdn_rows(ssm, q, k, v, g, beta)  # the recurrent rule token by token: decode's bits
        return self.gdn_output(w, o, z, mm)

    def attention_qkv(self, w: AttnWeights, h: np.ndarray, positions: np.ndarray, mm: MatMul
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """q [T, H, D], k, v [T, Hkv, D] (q/k normed and rotated) and the output gate [T, H·D].

        ``positions``: [T] int (one rotary position a token), or [T, 3] (temporal, height, width: an image prompt's
        rows, mrope.py).
        """
        hp = self.hp
        t, d = h.shape[0], hp.head_dim
        qg = mm(w.q, h).reshape(t, hp.num_attention_heads, 2 * d)
        q = ops.rms_norm(qg[:, :, :d], w.q_norm, hp.rms_norm_eps)
        gate = qg[:, :, d:].reshape(t, -1)
        k = ops.rms_norm(mm(w.k, h).reshape(t, hp.num_key_value_heads, d), w.k_norm, hp.rms_norm_eps)
        v = mm(w.v, h).reshape(t, hp.num_key_value_heads, d)
        if positions.ndim == 2:
            cos, sin = mrope_tables(positions, hp.rotary_dim, hp.rope_theta, self.mrope_section)
        else:
            cos, sin = ops.rope_tables(positions, hp.rotary_dim, hp.rope_theta)
        ops.apply_rope(q, cos, sin)
        ops.apply_rope(k, cos, sin)
        return q, k, v, gate

    def attention_output(self, w: AttnWeights, a: np.ndarray, gate: np.ndarray, mm: MatMul) -> np.ndarray:
        """a [T, H, D] gated by σ(gate) [T, H·D], then o_proj → [T, E]."""
        return mm(w.o, a.reshape(a.shape[0], -1) * ops.sigmoid(gate))

    def _attention(self, w: AttnWeights, h: np.ndarray, state: ModelState, i: int, start: int,
                   mm: MatMul) -> np.ndarray:
        t = h.shape[0]
        rows = multimodal_rows(state)
        positions = np.arange(start, start + t) if rows is None else rows.rope_positions(start, t)
        q, k, v, gate = self.attention_qkv(w, h, positions, mm)
        kc, vc = state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"]
        write_rows(kc, start, k)
        write_rows(vc, start, v)
        keys, values = read_rows(kc, start + t), read_rows(vc, start + t)  # the stored values
        a = ops.attention_rows(q, keys, values, np.arange(start, start + t))  # row r sees rows 0..start+r
        return self.attention_output(w, a, gate, mm)


if TYPE_CHECKING:  # mypy checks the adapter against the model contract (tandem/models/protocol.py)
    from tandem.models.protocol import Adapter, DraftHead, DraftHeadSource, Placeable, SpeculativeModel, VisionModel
    from tandem.models.qwen3_5.mtp import MTPHead

    def _satisfies_the_contract(model: Qwen3_5Model, head: MTPHead) -> None:
        as_model: SpeculativeModel[ModelState, _verify.TreeScratch] = model
        as_source: DraftHeadSource = model
        as_placeable: Placeable = model
        as_head: DraftHead = head
        as_adapter: Adapter = Qwen3_5Model
        as_vision: VisionModel = model
        del as_model, as_source, as_placeable, as_head, as_adapter, as_vision
