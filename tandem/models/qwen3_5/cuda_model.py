"""The Qwen3.5 dense text model on the CUDA backend: the verbs of ``Qwen3_5Model`` over device weights and state.

Built once from a loaded host model (``CudaQwen3_5Model(host)``, or ``host.on_device("cuda")``): every weight is
copied to the device once (tandem/backend/cuda/upload.py picks the GEMV of its format), norms / conv / gate
parameters as fp32, the embedding as BF16 bits when it is BF16-exact (else fp32). A sequence's state is a
``DeviceState`` (the host state's buffers, on the device), allocated once and written in place.

One arithmetic for every token (DESIGN.md, "Branch, undo, restore"): every projection is a row-invariant GEMV
(tensor-core path, tandem/backend/cuda/gemv.py), so a row's bits never depend on how many rows ran; the GDN and
attention kernels of decode, tree verify and commit share their per-token arithmetic (tests/test_cuda_gdn_seq.py
and tests/test_cuda_attention_tree.py check tree == decode bit for bit). So with ``FAST`` (the default):
- ``decode`` is one token through the layer loop (``_layers_fused``): the embedding row and the first norm in one
  launch, then per layer the fused projection (q|k|v, or qkv|z|a|b with the GDN conv in its epilogue), the mixer
  kernels (GDN: a block a v-head; attention: split-K partials and their combine) writing the output projection's
  split operand, the output projection (its epilogue adds the residual and its last blocks write the next norm's
  operand), the gate|up projection (SiLU·mul in its epilogue, writing the down projection's operand) and the down
  projection (residual + the next layer's norm): 5 launches a GDN layer, 6 an attention layer. The first decode of a state records these launches
  (tandem/backend/cuda/plan.py); later steps replay them with prebuilt argument blocks (about 4 µs of host time
  a launch), the token and the attention position passed as calls;
- ``prefill`` runs pieces of ≤ GDN_CHUNK tokens: the GDN recurrent scan over the piece (the bits of decoding
  it token by token) and the flash-style causal attention prefill (its own summation order: close to decode,
  not bitwise); the pieces end at absolute multiples of GDN_CHUNK, as on the host;
- ``verify_tree`` runs every node in one pass per layer: the GDN tree kernel walks the tree depth first with a
  shared-memory stack of state tiles, the attention tree kernel reads the cache below P plus each node's
  ancestor rows; recorded per (scratch, node count) as decode is, one [6, N] table uploaded per round; a tree
  of at most 4 nodes (2 in BF16: one MMA column tile) takes decode's fused layer loop, each residual add and norm
  in the GEMV before it (``VERIFY_FUSED``);
- ``commit`` replays the accepted path's kept GDN rows onto the entry state (one launch a layer) and copies the
  path's K/V rows (attn_commit_rows, one launch a layer): the state then has the bits of a plain decode of the path.
  With FAST it replays a LaunchPlan per (scratch, path length), the path uploaded into the plan's buffer.
``FAST = False`` keeps the per-token reference composition (per-token decode kernels for prefill, per-node state
copies for verify): the CPU glue test (tests/test_cuda_model_glue.py) runs it with NumPy stand-ins.
Logits are CuPy device arrays ([V] or [T/N, V] float32, the plan's buffers: overwritten by the next call of the
same verb); hidden states for the MTP drafter are host NumPy rows. The MTP head (``draft_heads``) runs on the
device too (tandem/models/qwen3_5/cuda_mtp.py).

Each layer op sits in one small method (``_gdn_decode``, ``_gdn_tokens``, ``_gdn_tree``, ``_gdn_commit``,
``_attn_decode``, ``_attn_tokens``, ``_attn_tree``, ``_attn_commit``, ``_mlp``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from tandem.backend.cuda import gemv
from tandem.backend.cuda.argmax import PendingToken, TokenReader
from tandem.backend.cuda.arrays import unchecked
from tandem.backend.cuda.attention_decode import DecodeStep, attention_decode_step, decode_scratch, inv_freq
from tandem.backend.cuda.embed import EmbedNormStep, embed, embed_norm
from tandem.backend.cuda.attention_tree import (CHUNK, CommitStep, TreePartials, TreeStep, attention_commit,
                                               attention_prefill_step, attention_tree_step)
from tandem.backend.cuda.gdn_seq import (GDNRows, TreePlan, gdn_commit, gdn_decode, gdn_prefill, gdn_tree, new_rows,
                                         tree_plan)
from tandem.backend.cuda.gdn_step import gdn_decode_step
from tandem.backend.cuda.loader import cupy, persistent
from tandem.backend.cuda.plan import LaunchPlan
from tandem.backend.cuda.plan import recordings as plan_recordings
from tandem.backend.cuda.rms_norm import add_rms_norm, rms_norm
from tandem.backend.cuda.silu_mul import silu_mul
from tandem.backend.cuda.upload import CudaF32Linear, bf16_bits, to_device_linear
from tandem.backend.numpy_ops import GDN_CHUNK
from tandem.checkpoint import Checkpoint
from tandem.models.device_state import DeviceState
from tandem.models.qwen3_5 import verify as _verify
from tandem.models.qwen3_5.cuda_scratch import CudaTreeScratch
from tandem.models.qwen3_5.hparams import HParams
from tandem.models.qwen3_5.model import Qwen3_5Model
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights, LayerWeights


@dataclass
class _GDN:
    """Device GDN weights: Linears in_qkv [C, E], in_z [Hv·dv, E], in_a/in_b [Hv, E], out [E, Hv·dv];
    conv [C, K], a_log/dt_bias [Hv], norm [dv] float32."""

    in_qkv: Any
    in_z: Any
    in_a: Any
    in_b: Any
    out: Any
    conv: Any
    a_log: Any
    dt_bias: Any
    norm: Any
    proj: Any = None  # in_qkv | in_z | in_a | in_b in one Linear (gemv.concat), when the format allows


@dataclass
class _Attn:
    """Device attention weights: Linears q [2·H·D, E], k/v [Hkv·D, E], o [E, H·D]; q_norm/k_norm [D] float32."""

    q: Any
    k: Any
    v: Any
    o: Any
    q_norm: Any
    k_norm: Any
    proj: Any = None  # q | k | v in one Linear (gemv.concat), when the format allows


@dataclass
class _Layer:
    """One device decoder layer: norms [E] float32 (1 + w), the mixer and the MLP Linears."""

    input_norm: Any
    post_norm: Any
    mixer: _GDN | _Attn
    gate: Any
    up: Any
    down: Any
    gate_up: Any = None  # gate and up in one Linear with the SiLU·mul epilogue (gemv.glu_pair), when the format allows


Mixer = Callable[[int, _Layer, Any], Any]
# Attention decode in one launch (the last partial block combines) or two (partials, then a combine block per
# head): two measured faster on the H200 at 27B shapes (bench/fusion.py: 23.6 vs 30.5 µs at position 128, 53 vs
# 79 µs at 4095), so decode takes two.
ATTN_FUSED = False
# Verifies of at most ``_fused_rows()`` nodes (4 with the fp16 operand kinds of FP8 / NVFP4, 2 with BF16's) take the
# decode's fused layer loop (``_layers_fused``): each residual add and norm in the epilogue of the GEMV before it
# (gemv ``matmul_residual_norm`` on T rows) instead of an add_rms_norm launch, the same bits. H200, session 20, 27B
# NVFP4 4-node verify traced: 128 add_rms_norm launches took 1.09 ms of 10.3 (bench/results/cuda_notes.md).
VERIFY_FUSED = True


def _fuse(parts: list[Any]) -> Any:
    """gemv.concat of device Linears that take the tensor-core path, else None (then they run one by one)."""
    if not all(isinstance(p, (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear))
               for p in parts):
        return None
    try:
        return gemv.concat(parts)
    except ValueError:
        return None


def _glu(gate: Any, up: Any) -> Any:
    """gemv.glu_pair of the MLP's gate and up (SiLU·mul in the GEMV's epilogue), else None (they run one by one)."""
    if not all(isinstance(p, (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear))
               for p in (gate, up)) or gate.prep_kind is None:
        return None
    try:
        return gemv.glu_pair(gate, up)
    except ValueError:
        return None


def _kind(lin: Any) -> str | None:
    """The split operand a Linear's tensor-core GEMV reads (gemv.PREP_KIND), or None (it takes fp32 rows)."""
    return getattr(lin, "prep_kind", None) if lin is not None else None


def _mm(lin: Any, a: Any, split: str | None = None, out: Any = None) -> Any:
    """lin's GEMV on an operand: a split xs [T, P, in] uint16 (from a norm / activation kernel) or fp32 [T, in].
    ``split``: a glu_pair's output operand kind; ``out``: an optional result buffer (fp32 results)."""
    if a.dtype == np.uint16:
        return lin.matmul_prepared(a, split=split, out=out)
    if split is not None:
        return lin.matmul(a, split=split, out=out)
    return lin.matmul(a) if out is None else lin.matmul(a, out=out)


def _cols(y: Any, sizes: Sequence[int], outs: Sequence[Any] | None = None) -> list[Any]:
    """Split y [T, sum(sizes)] by columns into C-contiguous pieces: views for T = 1, else one gemv.split_pieces
    launch for all of them (into ``outs[j]`` where given)."""
    if y.shape[0] > 1 and not isinstance(y, np.ndarray) and len(sizes) <= 4:
        return gemv.split_pieces(y, sizes, outs)
    out, start = [], 0
    for j, n in enumerate(sizes):
        dst = outs[j] if outs is not None else None
        if y.shape[0] == 1 and dst is None:
            piece = y[0, start:start + n].reshape(1, n)
        elif isinstance(y, np.ndarray):  # the CPU glue test's stand-in arrays
            piece = np.ascontiguousarray(y[:, start:start + n])
            if dst is not None:
                dst[...] = piece
                piece = dst
        else:
            piece = gemv.split_cols(y, start, n, out=dst)
        out.append(piece)
        start += n
    return out


def profile_key_for(device_name: str) -> str:
    """The price-profile key of a GPU named ``device_name``: "NVIDIA H200" -> ``cuda-nvidia-h200``."""
    return "cuda-" + (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu")


def profile_key() -> str:
    """The current GPU's price-profile key, e.g. ``cuda-nvidia-h200`` (profiles/<key>.json)."""
    props = cupy().cuda.runtime.getDeviceProperties(cupy().cuda.runtime.getDevice())
    return profile_key_for(props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]))


class CudaQwen3_5Model:
    """Qwen3.5 dense text model on one GPU; the verbs and attributes the engine and speculator use.

    Args: host: the loaded host model (kept: its MTP head and hyper-parameters are shared).
    Attributes: hp, host, path, head (device Linear [V, E]), layers, profile_device (price-profile key).
    Raises: ImportError without CuPy; ValueError for a Linear that cannot be uploaded.
    """

    FAST = True  # sequence / tree kernels and fused projections; False: the per-token reference composition
    # The engine allocates this model's states at its context size and reuses one across sequences (reset in place):
    # a state's recorded launch plans (decode, each verify size, each commit length) point into its buffers, so a
    # state of its own for each request would record them all again (27B, H200: 33-162 ms a verify size).
    reuses_states = True
    # prefill computes decode's bits for every token, so a state taken after decode steps (a session snapshot)
    # equals a cold prefill of the same tokens (tandem/cache/sequence.py)
    prefill_matches_decode = True

    def __init__(self, host: Qwen3_5Model) -> None:
        cp = cupy()
        self.host = host
        self._rows: GDNRows | None = None  # GDN per-token rows for prefill pieces (allocated on first use)
        self._checked: set[str] = set()  # verbs whose launches ran once with every argument checked
        self._resid: tuple[Any, Any, str | None] | None = None  # inside _layers_fused: (residual, norm, split)
        self.hp: HParams = host.hp
        self.raw = host.raw
        self.path = host.path
        self.eps = float(host.hp.rms_norm_eps)
        ckpt = Checkpoint.open(host.path) if host.path is not None else None
        w = host.weights
        bits = bf16_bits(w.embed)
        self.embed_bits: Any = cp.asarray(bits) if bits is not None else None          # [V, E] uint16 (BF16)
        self.embed_f32: Any = None if bits is not None else cp.asarray(w.embed, dtype=cp.float32)  # [V, E]
        if w.lm_head is not None:
            self.head: Any = to_device_linear(w.lm_head, ckpt)
        elif self.embed_bits is not None and self.hp.hidden_size % 8 == 0:
            from tandem.backend.cuda.gemv import CudaDenseLinear

            self.head = CudaDenseLinear(self.embed_bits)  # tied: the embedding's own device bits
        else:
            self.head = CudaF32Linear(self._widen_embed())
        self.norm = self._f32(w.norm)
        self.layers = [self._layer(lw, ckpt) for lw in w.layers]
        self.inv_freq = cp.asarray(inv_freq(self.hp.rotary_dim, self.hp.rope_theta))  # [rd/2] float32
        self.profile_device = profile_key()

    @classmethod
    def from_parts(cls, hp: HParams, embed_bits: Any, norm: Any, head: Any, layers: list[_Layer]) -> "CudaQwen3_5Model":
        """A model over device weights built elsewhere (bench/decode.py's synthetic checkpoints of real shapes):
        embed_bits [V, E] uint16 (BF16), norm [E] float32, head a device Linear [V, E], layers as ``_layer``
        builds them. No host model: no MTP head."""
        model = cls.__new__(cls)
        model.host = cast(Any, None)
        model.hp, model.raw, model.path = hp, None, None
        model.eps = float(hp.rms_norm_eps)
        model._rows = None
        model._checked = set()
        model._resid = None
        model.embed_bits, model.embed_f32 = embed_bits, None
        model.head, model.norm, model.layers = head, norm, layers
        model.inv_freq = cupy().asarray(inv_freq(hp.rotary_dim, hp.rope_theta))
        model.profile_device = profile_key()
        return model

    # ------------------------------------------------------------------------------------------ weights
    @staticmethod
    def _f32(a: np.ndarray) -> Any:
        return cupy().asarray(np.ascontiguousarray(a, dtype=np.float32))

    def _widen_embed(self) -> Any:
        if self.embed_f32 is not None:
            return self.embed_f32
        return (self.embed_bits.astype(cupy().uint32) << 16).view(cupy().float32)

    @staticmethod
    def _upload(lin: Any, ckpt: Checkpoint | None) -> Any:
        """A host Linear on the device (upload.to_device_linear)."""
        return to_device_linear(lin, ckpt)

    def _layer(self, lw: LayerWeights, ckpt: Checkpoint | None) -> _Layer:
        def up(lin: Any) -> Any:
            return self._upload(lin, ckpt)

        m = lw.mixer
        mixer: _GDN | _Attn
        if isinstance(m, AttnWeights):
            mixer = _Attn(up(m.q), up(m.k), up(m.v), up(m.o), self._f32(m.q_norm), self._f32(m.k_norm))
            if self.FAST:
                mixer.proj = _fuse([mixer.q, mixer.k, mixer.v])
                if mixer.proj is not None:
                    mixer.q = mixer.k = mixer.v = None
        else:
            assert isinstance(m, GDNWeights)
            mixer = _GDN(up(m.in_qkv), up(m.in_z), up(m.in_a), up(m.in_b), up(m.out), self._f32(m.conv),
                         self._f32(m.a_log), self._f32(m.dt_bias), self._f32(m.norm))
            if self.FAST:
                mixer.proj = _fuse([mixer.in_qkv, mixer.in_z, mixer.in_a, mixer.in_b])
                if mixer.proj is not None:
                    mixer.in_qkv = mixer.in_z = mixer.in_a = mixer.in_b = None
        layer = _Layer(self._f32(lw.input_norm), self._f32(lw.post_norm), mixer, up(lw.mlp.gate), up(lw.mlp.up),
                       up(lw.mlp.down))
        if self.FAST:
            layer.gate_up = _glu(layer.gate, layer.up)
            if layer.gate_up is not None:
                layer.gate = layer.up = None
            cupy().get_default_memory_pool().free_all_blocks()  # the fused copies replaced their parts
        return layer

    # ------------------------------------------------------------------------------------------ cold verbs
    def new_state(self, max_len: int) -> DeviceState:
        """A zeroed device state for a sequence of at most ``max_len`` tokens (the host model's buffer specs)."""
        return DeviceState(Qwen3_5Model.state_specs(cast(Any, self), max_len), max_len)

    def new_tree_scratch(self, max_nodes: int) -> CudaTreeScratch:
        """Per-sequence verify/commit device buffers for trees of at most ``max_nodes`` nodes (allocated once)."""
        return CudaTreeScratch(self.hp, max_nodes, per_node_states=not self.FAST)

    def draft_heads(self) -> Any:
        """The checkpoint's MTP head on the device (tandem/models/qwen3_5/cuda_mtp.py, uploaded on first use from
        the host model's); None if the checkpoint has none, or for a model built ``from_parts`` without one."""
        head = getattr(self, "_draft_head", None)
        if head is None and self.host is not None:
            host_head = self.host.draft_heads()
            if host_head is not None:
                from tandem.models.qwen3_5.cuda_mtp import CudaMTPHead

                ckpt = Checkpoint.open(self.path) if self.path is not None else None
                head = self._draft_head = CudaMTPHead.upload(self, host_head, ckpt)
        return head

    def synchronize(self) -> None:
        """Wait for the device's queued work (for timing: the verbs return before the GPU finishes)."""
        cupy().cuda.get_current_stream().synchronize()

    def _plannable(self) -> bool:
        """Whether every launch of decode / verify goes through the kernel launchers, which a LaunchPlan records:
        the BF16 embedding kernel and every Linear a GEMV of tandem/backend/cuda/gemv.py (the fp32 fallback
        Linear runs cuBLAS and CuPy copies, which a plan would not replay)."""
        cached: bool | None = getattr(self, "_plannable_cache", None)
        if cached is None:
            lins = [self.head]
            for lw in self.layers:
                m = lw.mixer
                parts = [m.proj, m.in_qkv, m.in_z, m.in_a, m.in_b, m.out] if isinstance(m, _GDN) else \
                    [m.proj, m.q, m.k, m.v, m.o]
                lins += parts + [lw.gate_up, lw.gate, lw.up, lw.down]
            gemvs = (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear)
            cached = self.embed_bits is not None and all(lin is None or isinstance(lin, gemvs) for lin in lins)
            self._plannable_cache = cached
        return cached

    def _fusable(self) -> bool:
        """Whether a decode row can run ``_layers_fused``: the BF16 embedding, and every projection on the
        tensor-core path (the out / o / down GEMVs take the residual + norm epilogue, the norms' consumers read
        its split operand), the MLPs as glu_pairs."""
        cached: bool | None = getattr(self, "_fusable_cache", None)
        if cached is None:
            def v2(lin: Any) -> bool:
                return isinstance(lin, (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear)) \
                    and lin.prep_kind is not None

            def layer_ok(lw: _Layer) -> bool:
                m = lw.mixer
                out = m.out if isinstance(m, _GDN) else m.o
                return all(v2(lin) for lin in (m.proj, out, lw.gate_up, lw.down))

            cached = self.embed_bits is not None and v2(self.head) and all(layer_ok(lw) for lw in self.layers)
            self._fusable_cache = cached
        return cached

    @contextlib.contextmanager
    def _launch_checks(self, verb: str) -> Iterator[None]:
        """The first call of a verb checks every kernel argument (tandem.backend.cuda.arrays.require); later calls
        build the same arguments and skip the checks (about a microsecond of host time per launch). The verbs'
        own input checks (ids, state capacity, tree shape) always run."""
        if verb in self._checked:
            with unchecked():
                yield
            return
        yield
        self._checked.add(verb)

    # ------------------------------------------------------------------------------------------ hot verbs
    def prefill(self, state: DeviceState, ids: Sequence[int], all_logits: bool = False,
                hidden_out: list[np.ndarray] | None = None) -> Any:
        """Run ``ids`` at positions state.length.. and append them to the state (decode's bits for every token).

        Pieces end at absolute multiples of GDN_CHUNK (as the host's chunked prefill).
        Returns: logits [V] float32 (device) of the last token, or [T, V] with ``all_logits``. With
        ``hidden_out``, host post-final-norm hidden states [piece, E] float32 are appended (the MTP input).
        Raises: ValueError if ids is empty, holds an id outside the vocabulary or overflows the state.
        """
        Qwen3_5Model._check_ids(cast(Any, self), cast(Any, state), ids)
        cp = cupy()
        logits: list[Any] = []
        last: Any = None  # [piece, E] hidden of the latest piece
        base = pos = state.length
        end = base + len(ids)
        while pos < end:
            stop = min(end, (pos // GDN_CHUNK + 1) * GDN_CHUNK)
            with self._launch_checks("prefill"):
                last = self._forward_tokens(state, ids[pos - base:stop - base], pos)
            if all_logits:
                logits.append(self.head.matmul(last))
            if hidden_out is not None:
                hidden_out.append(cp.asnumpy(last))
            pos = state.length = stop
        if all_logits:
            return cp.concatenate(logits)
        return self.head.matmul(last[-1:])[0]

    def choose_on_device(self, state: DeviceState, logits: Any, params: Any = None, seed: int = 0,
                         position: int = 0, penalties: Any = None) -> PendingToken:
        """The next id from device logits [V] float32, chosen on the device: the argmax (params None or greedy)
        or the sampler at (seed, position) (tandem/backend/cuda/sample.py; no masks), after an active
        ``PenaltyState``'s penalties (kept on the device from the first call: the ids chosen since are counted
        there, the logits penalised in place); the host copy is queued and not waited for
        (tandem/backend/cuda/argmax.py TokenReader, one per state). Pass the result to ``decode`` to queue the next
        step before reading the id; ``get()`` reads it (-1: no token left).
        Raises: ValueError on bad logits or settings."""
        reader = state.token_reader
        if reader is None:
            reader = state.token_reader = TokenReader()
        pending: PendingToken = reader.choose(logits, params, seed, position, penalties)
        return pending

    def decode(self, state: DeviceState, token: int | PendingToken,
               hidden_out: list[np.ndarray] | None = None) -> Any:
        """One token at position state.length.

        ``token``: a host id, or a ``PendingToken`` of ``choose_on_device`` on this state: when it is the latest id
        chosen and the step runs its launch plan, the embedding kernel reads the id on the device and the host
        does not wait for it (same bits as passing its value); otherwise its value is read first.
        Returns: logits [V] float32 (device); with ``hidden_out``, its host hidden state [1, E] is appended.
        Raises: ValueError on a bad id or a full state.
        """
        on_device: Any = None  # the id's device int32 [1], when the embedding reads it there
        tid = 0
        if not isinstance(token, PendingToken):
            tid = token
        elif token.latest and token.reader is state.token_reader and self.FAST and self._plannable() \
                and self._fusable() and int(self.head.shape[0]) <= int(self.embed_bits.shape[0]):
            on_device = token.reader.device  # an id over the head's rows is one of the embedding's (else row 0)
        else:
            tid = token.get()
        Qwen3_5Model._check_ids(cast(Any, self), cast(Any, state), [tid])  # a device id: 0 stands in (capacity)
        pos = state.length
        if on_device is not None:
            normed, logits = self._decode_planned(state, on_device, pos)
        elif self.FAST and self._plannable():
            normed, logits = self._decode_planned(state, tid, pos)
        else:
            def mixer(i: int, lw: _Layer, h: Any) -> Any:
                if isinstance(lw.mixer, _Attn):
                    return self._attn_decode(i, lw.mixer, h, state, pos)
                return self._gdn_decode(i, lw.mixer, h, state)

            with self._launch_checks("decode"):
                if self.FAST and self._fusable():
                    x = cupy().empty((1, self.hp.hidden_size), dtype=np.float32)
                    first = self.layers[0]
                    h = embed_norm(self.embed_bits, tid, first.input_norm, self.eps, x,
                                   split=_kind(first.mixer.proj))
                    normed, logits = self._layers_fused(x, h, mixer)
                    logits = logits[0]
                else:
                    normed = self._layers(self._embed([tid]), mixer)
                    logits = self.head.matmul(normed)[0]
        state.length = pos + 1
        if hidden_out is not None:
            hidden_out.append(cupy().asnumpy(normed))
        return logits

    def _decode_planned(self, state: DeviceState, token: Any, pos: int) -> tuple[Any, Any]:
        """One decode step through the state's LaunchPlan (tandem/backend/cuda/plan.py): the first step runs the
        layer loop normally and records its launches; later steps replay them, the embedding (the token: a host
        id, or a device int32 [1] read by the kernel) and each attention layer (the position) running as calls.
        Same kernels, same arguments, same bits.
        Returns (normed [1, E], logits [V]): the plan's own buffers, overwritten by the next step."""
        plan: LaunchPlan | None = state.decode_plan
        if plan is not None and plan.vars.get("model") is self:  # a plan replays its own model's weights
            plan.vars["token"], plan.vars["pos"] = token, pos
            plan.replay()
            normed, logits = plan.outputs
            return normed, logits
        cp, hp = cupy(), self.hp
        plan = LaunchPlan()
        plan.vars = {"token": token, "pos": pos, "model": self}
        x = cp.empty((1, hp.hidden_size), dtype=cp.float32)  # the residual stream, updated in place
        bits, vars_ = self.embed_bits, plan.vars
        attn_scratch: list[tuple[Any, Any, Any]] = []  # the attention partials' buffers, made at the first layer

        def mixer(i: int, lw: _Layer, h: Any) -> Any:
            w = lw.mixer
            if isinstance(w, _GDN):
                return self._gdn_decode(i, w, h, state)
            kc, vc = state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"]
            if not attn_scratch:  # the partials' buffers, sized for the cache, shared by the attention layers
                attn_scratch.append(decode_scratch(kc, hp.num_attention_heads))
            return self._attn_decode_planned(plan, w, h, kc, vc, attn_scratch[0])

        with plan.record(), self._launch_checks("decode"):
            if self._fusable():  # the embedding and the first norm in one launch, each norm in the GEMV before it
                first = self.layers[0]
                kind = _kind(first.mixer.proj)
                h = cp.empty((1, gemv.PARTS[kind], hp.hidden_size), dtype=cp.uint16) if kind else cp.empty_like(x)
                embed_step = EmbedNormStep(bits, first.input_norm, self.eps, x, split=kind, out=h)
                plan.add_call(lambda: embed_step(vars_["token"]))
                normed, logits = self._layers_fused(x, h, mixer)
                logits = logits[0]
            else:
                plan.add_call(lambda: embed(bits, [vars_["token"]], out=x))
                normed = self._layers(x, mixer)
                logits = self.head.matmul(normed)[0]
        plan.outputs = (normed, logits)
        state.decode_plan = plan
        return normed, logits

    def _attn_decode_planned(self, plan: LaunchPlan, w: _Attn, h: Any, kc: Any, vc: Any,
                             scratch: tuple[Any, Any, Any]) -> Any:
        """An attention layer's decode row while ``plan`` records: the projections recorded, the attention a call
        at ``plan.vars["pos"]`` of each replay (attention_decode.DecodeStep over the caches kc / vc [max_len, Hkv, D]
        and the partials' buffers ``scratch``), then the o projection (``_out_proj``). Returns its result."""
        cp, hp, vars_ = cupy(), self.hp, plan.vars
        qg, k, v = self._qkv(w, h)
        kind, width = _kind(w.o), hp.num_attention_heads * hp.head_dim
        # a call (the position and the grid follow the step) through prebuilt argument blocks (DecodeStep)
        if kind is not None:  # the combine writes the o projection's split operand
            xs = cp.empty((1, gemv.PARTS[kind], width), dtype=cp.uint16)
            step = DecodeStep(qg[0], k[0], v[0], w.q_norm, w.k_norm, self.inv_freq, kc, vc, self.eps, split=kind,
                              xs=xs, fused=ATTN_FUSED, scratch=scratch)
            plan.add_call(lambda: step(vars_["pos"]))
            return self._out_proj(w.o, xs)
        y = cp.empty((1, width), dtype=cp.float32)
        step = DecodeStep(qg[0], k[0], v[0], w.q_norm, w.k_norm, self.inv_freq, kc, vc, self.eps, out=y[0],
                          scratch=scratch)
        plan.add_call(lambda: step(vars_["pos"]))
        return self._out(w.o, y)

    def verify_tree(self, state: DeviceState, scratch: CudaTreeScratch, token_ids: Sequence[int],
                    parent_ids: Sequence[int]) -> Any:
        """Run a draft tree after the committed tokens (tandem/models/qwen3_5/verify.py's contract).

        Args: state: its length P is the root's position; attention rows ≥ P are scratch until commit, sections
        are read only. scratch: ``new_tree_scratch``. token_ids, parent_ids: [N], node 0 the root (-1).
        Returns: logits [N, V] float32 (device); row i has the bits of a plain decode of node i after its path.
        Raises: ValueError on a malformed tree, a bad id, too many nodes or a tree past the state's end.
        """
        depths = _verify._check_tree(cast(Any, self), cast(Any, state), cast(Any, scratch), token_ids, parent_ids)
        scratch.begin(list(parent_ids), depths, state.length)
        if self.FAST and self._plannable():
            return self._verify_planned(state, scratch, token_ids, parent_ids, depths)
        if self.FAST:  # every index table of the round in one host-to-device copy (a pageable copy syncs)
            plan = tree_plan(parent_ids)
            table = cupy().asarray(np.asarray([list(parent_ids), plan.order, plan.restore, plan.save, depths],
                                              dtype=np.int32))
            scratch.tables = (plan, table[:4], table[4], table[0])

        def mixer(i: int, lw: _Layer, h: Any) -> Any:
            if isinstance(lw.mixer, _Attn):
                return self._attn_tree(i, lw.mixer, h, state, scratch)
            return self._gdn_tree(i, lw.mixer, h, state, scratch)

        with self._launch_checks("verify"):
            normed, logits = self._verify_layers(self._embed(token_ids), mixer)
        scratch.set_hidden(normed)
        return logits

    # StairCut verifies trees of these sizes where the tree fills one (Speculator._recorded_size), so a state keeps a
    # recorded plan for each instead of recording again whenever the size moves (H200, 27B NVFP4, bench-style tree:
    # recording a verify 33-162 ms of host time against a 6.5-16.7 ms replay; its plan's memory pool 4.2 MB at 2 nodes
    # to 70.7 MB at 32, ~236 MB for these sizes together). Other sizes (a tree smaller than any) still take a plan.
    verify_sizes = (2, 3, 4, 6, 8, 12, 16, 24, 32)

    @property
    def plan_recordings(self) -> int:
        """Launch plans recorded so far in this process (tandem/backend/cuda/plan.py ``recordings``; the MTP head's
        included): the engine leaves a round whose count moved out of StairCut's prices, since a recording costs
        far more host time than the replays it prices."""
        return plan_recordings()

    MAX_VERIFY_PLANS = 11  # recorded verify plans kept per state (one per tree size; least recently used dropped)

    def _verify_planned(self, state: DeviceState, scratch: CudaTreeScratch, token_ids: Sequence[int],
                        parent_ids: Sequence[int], depths: list[int]) -> Any:
        """Tree verify through a LaunchPlan per (scratch, node count), as ``_decode_planned``: every round uploads
        one int32 table [6, N] (ids, parents, DFS order, restore, save, depths) and replays; attention layers
        (their chunk count follows the position) run as calls. The GDN scan is recorded with shared memory for
        floor(log2 N) saved state tiles, the most any N-node tree needs (a tree needing more re-records)."""
        cp, hp, n = cupy(), self.hp, len(token_ids)
        tp = tree_plan(parent_ids)
        host = np.asarray([list(token_ids), list(parent_ids), tp.order, tp.restore, tp.save, depths], dtype=np.int32)
        plans: dict[tuple[int, int], LaunchPlan] = state.verify_plans
        key = (id(scratch), n)
        plan = plans.pop(key, None)
        # the plan holds its scratch (so the id in the key stays that scratch's) and its model
        if plan is not None and plan.vars["scratch"] is scratch and plan.vars["model"] is self \
                and plan.vars["slots"] >= tp.num_slots:
            plans[key] = plan  # most recently used last
            plan.vars["table"].set(host)
            plan.vars["start"] = state.length
            plan.replay()
            scratch.hidden_written(n)
            return plan.outputs
        with persistent():
            table = cp.asarray(host)
        slots = max(tp.num_slots, int(np.log2(n)) if n > 1 else 0)
        scratch.tables = (TreePlan(tp.order, tp.restore, tp.save, slots), table[1:5], table[5], table[1])
        plan = LaunchPlan()
        plan.vars = {"table": table, "start": state.length, "slots": slots, "scratch": scratch, "model": self}
        vars_ = plan.vars
        need = -(-state.max_len // CHUNK)  # the attention layers' partials: one set a scratch, grown with the position
        partials = scratch.attn_partials
        if partials is None or partials.max_chunks < need:
            partials = scratch.attn_partials = TreePartials(need)

        def mixer(i: int, lw: _Layer, h: Any) -> Any:
            w = lw.mixer
            if isinstance(w, _GDN):
                return self._gdn_tree(i, w, h, state, scratch)
            qg, k, v = self._qkv(w, h)
            kind, width = _kind(w.o), hp.num_attention_heads * hp.head_dim
            kc, vc = state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"]
            kn, vn = scratch.buffers[f"{i}.k"][:n], scratch.buffers[f"{i}.v"][:n]
            # a call (the committed length and the chunk grid follow the round) through prebuilt argument blocks
            if kind is not None:  # the combine writes the o projection's split operand
                xs = cp.empty((n, gemv.PARTS[kind], width), dtype=cp.uint16)
                step = TreeStep(qg, k, v, w.q_norm, w.k_norm, self.inv_freq, kc, vc, table[5], table[1], self.eps, kn,
                                vn, split=kind, xs=xs, partials=partials)
                plan.add_call(lambda: step(vars_["start"]))
                return self._out_proj(w.o, xs)
            if self._resid is not None:  # _fusable() rules it out: the fused loop's o projections read split operands
                raise RuntimeError("_layers_fused: an attention layer without a split o operand")
            y = cp.empty((n, width), dtype=cp.float32)
            step = TreeStep(qg, k, v, w.q_norm, w.k_norm, self.inv_freq, kc, vc, table[5], table[1], self.eps, kn, vn,
                            out=y, partials=partials)
            plan.add_call(lambda: step(vars_["start"]))
            return self._out(w.o, y)

        logits = scratch.logits(int(self.head.shape[0]))[:n]  # shared by the plans of every size (made outside)
        with plan.record(), self._launch_checks("verify"):
            x = embed(self.embed_bits, token_ids, ids_device=table[0])
            _, plan.outputs = self._verify_layers(x, mixer, out=scratch.hidden_device[:n], logits_out=logits)
        scratch.hidden_written(n)
        plans[key] = plan
        while len(plans) > self.MAX_VERIFY_PLANS:
            plans.pop(next(iter(plans)))
        return plan.outputs

    def commit(self, state: DeviceState, scratch: CudaTreeScratch, path: Sequence[int]) -> None:
        """Append the accepted ``path`` (root-to-node chain of the last verify) to the state, with the bits of
        decoding its tokens one by one. Raises: ValueError for a bad path or a state moved since verify."""
        if state.length != scratch.start:
            raise ValueError(f"state length {state.length} differs from the verified tree's start {scratch.start}")
        n = len(scratch.parent_ids)
        if not path or path[0] != 0 or any(not 0 <= p < n for p in path) \
                or any(scratch.parent_ids[path[j]] != path[j - 1] for j in range(1, len(path))):
            raise ValueError(f"path {list(path)} is not a root-to-node chain of the verified tree")
        if self.FAST and self._plannable():
            self._commit_planned(state, scratch, path)
        else:
            rows = cupy().asarray(np.asarray(path, dtype=np.int32))  # one upload for every layer
            with self._launch_checks("commit"):
                for i, lw in enumerate(self.layers):
                    if isinstance(lw.mixer, _Attn):
                        self._attn_commit(i, state, scratch, rows, path)
                    else:
                        self._gdn_commit(i, lw.mixer, state, scratch, path, rows)
        state.length += len(path)

    MAX_COMMIT_PLANS = 64  # recorded commits kept per state (one per scratch and path length; least recent dropped)

    def _commit_planned(self, state: DeviceState, scratch: CudaTreeScratch, path: Sequence[int]) -> None:
        """The commit through a LaunchPlan per (scratch, path length), as ``_verify_planned``: each call uploads the
        path (int32 [L]) into the plan's buffer and replays: a GDN layer's replay of the path onto its entry state
        (gdn_commit: its rows are views of the scratch's fixed buffers whatever the tree's size), an attention
        layer's row copies as a call (attention_tree.CommitStep: the start follows the state). Same kernels and
        arguments as the unplanned commit, so the same bits. H200, bench/host_replay.py: the unplanned commit of a
        3-node path took 6.9 ms of host time at 27B (3.7 at 9B), for ~0.5 ms of kernels."""
        cp = cupy()
        host = np.asarray(path, dtype=np.int32)
        plans: dict[tuple[int, int], LaunchPlan] = state.commit_plans
        key = (id(scratch), len(path))
        plan = plans.pop(key, None)
        if plan is not None and plan.vars["scratch"] is scratch and plan.vars["model"] is self:
            plans[key] = plan  # most recently used last
            plan.vars["path"].set(host)
            plan.vars["start"] = state.length
            plan.replay()
            return
        with persistent():
            path_dev = cp.asarray(host)
        plan = LaunchPlan()
        plan.vars = {"path": path_dev, "start": state.length, "scratch": scratch, "model": self}
        vars_, buf = plan.vars, scratch.buffers

        def at_start(step: CommitStep) -> Callable[[], None]:  # the step at the state's length of each replay
            return lambda: step(vars_["start"])

        with plan.record(), self._launch_checks("commit"):
            for i, lw in enumerate(self.layers):
                if isinstance(lw.mixer, _Attn):
                    step = CommitStep(state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"], buf[f"{i}.k"],
                                      buf[f"{i}.v"], path_dev, len(path))
                    plan.add_call(at_start(step))
                else:  # recorded: gdn_commit on the plan's path buffer (its rows do not depend on the tree's size)
                    self._gdn_commit(i, lw.mixer, state, scratch, path, path_dev)
        plans[key] = plan
        while len(plans) > self.MAX_COMMIT_PLANS:
            plans.pop(next(iter(plans)))

    # ------------------------------------------------------------------------------------------ layer loop
    def _embed(self, ids: Sequence[int]) -> Any:
        """Embedding rows [T, E] float32 (a fresh array: the residual stream is updated in place)."""
        cp = cupy()
        if self.embed_bits is not None and self.FAST:
            return embed(self.embed_bits, ids)  # one launch; a single id goes by value
        idx = cp.asarray(np.asarray(ids, dtype=np.int64))
        if self.embed_bits is not None:
            return (self.embed_bits[idx].astype(cp.uint32) << 16).view(cp.float32)
        return cp.ascontiguousarray(self.embed_f32[idx])

    def _norm(self, x: Any, delta: Any, weight: Any, consumer: Any) -> Any:
        """(x += delta), then RMSNorm written as ``consumer``'s GEMV operand (split xs, or fp32 rows)."""
        kind = _kind(consumer)
        if delta is None:
            return rms_norm(x, weight, self.eps, split=kind) if kind else rms_norm(x, weight, self.eps)
        return add_rms_norm(x, delta, weight, self.eps, split=kind) if kind else \
            add_rms_norm(x, delta, weight, self.eps)

    def _layers(self, x: Any, mixer: Mixer, out: Any = None) -> Any:
        """x [T, E] through every layer (residual in place); returns the post-final-norm hidden [T, E] (into
        ``out`` when given)."""
        delta = None
        for i, lw in enumerate(self.layers):
            delta = mixer(i, lw, self._norm(x, delta, lw.input_norm, lw.mixer.proj))
            delta = self._mlp(lw, self._norm(x, delta, lw.post_norm, lw.gate_up))
        if out is not None:
            return add_rms_norm(x, delta, self.norm, self.eps, out=out)
        return add_rms_norm(x, delta, self.norm, self.eps)

    def _fused_rows(self) -> int:
        """The most rows ``_layers_fused`` takes: the residual + norm GEMVs' (gemv ``resnorm_rows``: one MMA column
        tile of tokens, 4 for FP8 / NVFP4, 2 for BF16); 0 where the model is not ``_fusable``."""
        cached: int | None = getattr(self, "_fused_rows_cache", None)
        if cached is None:
            cached = 0
            if self._fusable():
                cached = min(min(lin.resnorm_rows() for lin in (lw.mixer.out if isinstance(lw.mixer, _GDN) else
                                                                 lw.mixer.o, lw.down)) for lw in self.layers)
            self._fused_rows_cache = cached
        return cached

    def _verify_layers(self, x: Any, mixer: Mixer, out: Any = None, logits_out: Any = None) -> tuple[Any, Any]:
        """A verify's embedding rows x [N, E] float32 (the residual stream, updated in place) through every layer
        and the head: ``_layers_fused`` (each norm in the GEMV before it) where N ≤ ``_fused_rows()`` and
        VERIFY_FUSED, else ``_layers`` (add_rms_norm launches); the same bits. Returns (normed [N, E] post-final-norm
        hidden, into ``out`` when given; logits [N, V], into ``logits_out`` when given)."""
        n = int(x.shape[0])
        if VERIFY_FUSED and self.FAST and n <= self._fused_rows():
            first = self.layers[0]
            h = rms_norm(x, first.input_norm, self.eps, split=_kind(first.mixer.proj))
            return self._layers_fused(x, h, mixer, normed=out, logits_out=logits_out)
        hidden = self._layers(x, mixer, out=out)
        return hidden, _mm(self.head, hidden, out=logits_out)

    def _layers_fused(self, x: Any, h: Any, mixer: Mixer, normed: Any = None,
                      logits_out: Any = None) -> tuple[Any, Any]:
        """T ≤ ``_fused_rows()`` rows (a decode row, a small verify) through every layer with each residual add and
        RMSNorm in the epilogue of the GEMV before it (gemv ``matmul_residual_norm``: its last blocks norm the
        updated rows and write the next GEMV's split operand), so a layer is its projections and mixer kernels
        only. Args: x [T, E] float32, the residual stream (the embedding rows; updated in place); h: the first
        projection's operand (embed_norm, or rms_norm of x); normed: optional [T, E] float32 buffer for the
        post-final-norm hidden; logits_out: optional [T, V] float32 buffer for the logits. The bits equal ``_layers``
        then the head (same arithmetic: tests/test_cuda_gemv.py, tests/test_cuda_engine.py). Returns (normed [T, E]
        post-final-norm hidden, logits [T, V])."""
        normed = cupy().empty_like(x) if normed is None else normed
        last = len(self.layers) - 1
        try:
            for i, lw in enumerate(self.layers):
                self._resid = (x, lw.post_norm, _kind(lw.gate_up))
                act = _mm(lw.gate_up, mixer(i, lw, h), split=_kind(lw.down))  # the mixer's out GEMV adds, norms
                if i < last:
                    nxt = self.layers[i + 1]
                    h = lw.down.matmul_residual_norm(act, x, nxt.input_norm, self.eps, split=_kind(nxt.mixer.proj))
                else:
                    h = lw.down.matmul_residual_norm(act, x, self.norm, self.eps, split=_kind(self.head),
                                                     normed_out=normed)
        finally:
            self._resid = None
        return normed, _mm(self.head, h, out=logits_out)

    def _out_proj(self, lin: Any, a: Any) -> Any:
        """A mixer's output projection: y = a · Wᵀ, or inside ``_layers_fused`` the residual add and the post-mixer
        norm in its epilogue (returning the gate|up GEMV's operand)."""
        resid = self._resid
        if resid is None:
            return _mm(lin, a)
        if a.dtype != np.uint16:  # _fusable() rules it out: every out / o projection reads a split operand
            raise RuntimeError("_layers_fused: an output projection's operand must be its split (uint16) form")
        x, weight, kind = resid
        return lin.matmul_residual_norm(a, x, weight, self.eps, split=kind)

    def _forward_tokens(self, state: DeviceState, ids: Sequence[int], start: int) -> Any:
        """Post-final-norm hidden [T, E] of tokens at start..start+T-1, layer by layer, token steps inside."""
        def mixer(i: int, lw: _Layer, h: Any) -> Any:
            if isinstance(lw.mixer, _Attn):
                return self._attn_tokens(i, lw.mixer, h, state, start)
            return self._gdn_tokens(i, lw.mixer, h, state)

        return self._layers(self._embed(ids), mixer)

    @staticmethod
    def _mlp(lw: _Layer, h: Any) -> Any:
        """down(silu(gate(h)) · up(h)); with a glu_pair the activation comes out of the gate|up GEMV's epilogue,
        already split for the down projection."""
        if lw.gate_up is None:
            return lw.down.matmul(silu_mul(lw.gate.matmul(h), lw.up.matmul(h)))
        return _mm(lw.down, _mm(lw.gate_up, h, split=_kind(lw.down)))

    @staticmethod
    def _out(lin: Any, y: Any) -> Any:
        """The output projection of a mixer's result y [T, n] float32."""
        return lin.matmul(y)

    # ------------------------------------------------------------------------------------------ GDN
    def _gdn_step(self, w: _GDN, mixed: Any, tail: Any, a: Any, b: Any, z: Any, ssm: Any, out: Any = None) -> Any:
        """One GDN token (tail and ssm updated in place); returns y [Hv·dv] (out_proj's input)."""
        return gdn_decode_step(mixed, tail, w.conv, a, b, w.a_log, w.dt_bias, z, w.norm, ssm,
                               self.hp.linear_num_key_heads, self.eps, out=out)

    def _gdn_proj(self, w: _GDN, h: Any, mixed_out: Any = None) -> tuple[Any, Any, Any, Any]:
        """mixed [T, C] (into ``mixed_out`` if given), z [T, Hv·dv], a, b [T, Hv], each C-contiguous."""
        if w.proj is not None:
            mixed, z, a, b = _cols(_mm(w.proj, h), w.proj.splits, [mixed_out, None, None, None])
            return mixed, z, a, b
        mixed = w.in_qkv.matmul(h) if mixed_out is None else w.in_qkv.matmul(h, out=mixed_out)
        return mixed, w.in_z.matmul(h), w.in_a.matmul(h), w.in_b.matmul(h)

    def _rows_for(self, n: int) -> GDNRows:
        """GDN per-token rows [n, ...] (views of one buffer of GDN_CHUNK rows, reused by every layer)."""
        if self._rows is None:
            hp = self.hp
            with persistent():
                self._rows = new_rows(GDN_CHUNK, hp.linear_num_key_heads, hp.linear_num_value_heads,
                                  hp.linear_key_head_dim, hp.linear_value_head_dim)
        return GDNRows(*(f[:n] for f in self._rows))

    def _gdn_decode(self, i: int, w: _GDN, h: Any, state: DeviceState) -> Any:
        if not self.FAST:
            mixed, z, a, b = w.in_qkv.matmul(h), w.in_z.matmul(h), w.in_a.matmul(h), w.in_b.matmul(h)
            y = self._gdn_step(w, mixed[0], state.buffers[f"layers.{i}.conv"], a[0], b[0], z[0],
                               state.buffers[f"layers.{i}.ssm"])
            return w.out.matmul(y[None])
        return self._gdn_tokens(i, w, h, state)

    def _gdn_tokens(self, i: int, w: _GDN, h: Any, state: DeviceState) -> Any:
        tail, ssm = state.buffers[f"layers.{i}.conv"], state.buffers[f"layers.{i}.ssm"]
        if self.FAST:  # the recurrent kernels: the bits of T decode steps (tests/test_cuda_gdn_seq.py)
            kind = _kind(w.out)
            if w.proj is not None and h.dtype == np.uint16 and int(h.shape[0]) == 1:
                # decode: the conv in the projection's epilogue, then one block a v-head writing out_proj's operand
                u, z, a, b = _cols(w.proj.matmul_conv(h, tail, w.conv), w.proj.splits)
                y = gdn_decode(u, tail, w.conv, a, b, w.a_log, w.dt_bias, z, w.norm, ssm, self.hp.linear_num_key_heads,
                               self.eps, split=kind, conv_done=True)
                return self._out_proj(w.out, y)
            mixed, z, a, b = self._gdn_proj(w, h)
            n = int(mixed.shape[0])
            if n == 1:  # two launches (conv, then a block a v-head), writing out_proj's operand
                y = gdn_decode(mixed, tail, w.conv, a, b, w.a_log, w.dt_bias, z, w.norm, ssm,
                               self.hp.linear_num_key_heads, self.eps, split=kind)
                return self._out_proj(w.out, y)
            y = gdn_prefill(mixed, tail, w.conv, a, b, w.a_log, w.dt_bias, z, w.norm, ssm,
                            self.hp.linear_num_key_heads, self.eps, rows=self._rows_for(n), split=kind)
            return _mm(w.out, y)
        mixed, z, a, b = w.in_qkv.matmul(h), w.in_z.matmul(h), w.in_a.matmul(h), w.in_b.matmul(h)
        y = cupy().empty((h.shape[0], self.hp.value_dim), dtype=np.float32)
        for t in range(h.shape[0]):
            self._gdn_step(w, mixed[t], tail, a[t], b[t], z[t], ssm, out=y[t])
        return w.out.matmul(y)

    def _gdn_tree(self, i: int, w: _GDN, h: Any, state: DeviceState, scratch: CudaTreeScratch) -> Any:
        n, buf = int(h.shape[0]), scratch.buffers
        tail, ssm = state.buffers[f"layers.{i}.conv"], state.buffers[f"layers.{i}.ssm"]
        if self.FAST:  # DFS over the tree with a shared-memory stack of state tiles (cuda/gdn_seq.cu)
            pre = buf[f"{i}.pre"][:n]  # the pre-conv rows, kept for commit
            mixed, z, a, b = self._gdn_proj(w, h, mixed_out=pre)
            plan, table, _, _ = scratch.tables
            y, _ = gdn_tree(pre, scratch.parent_ids, tail, w.conv, a, b, w.a_log, w.dt_bias, z, w.norm, ssm,
                            self.hp.linear_num_key_heads, self.eps, rows=scratch.gdn_rows(i, n), tables=(plan, table),
                            split=_kind(w.out))
            return self._out_proj(w.out, y)
        pre, z, a, b = buf[f"{i}.pre"], buf[f"{i}.z"], buf[f"{i}.a"], buf[f"{i}.b"]
        pre[:n], z[:n] = w.in_qkv.matmul(h), w.in_z.matmul(h)
        a[:n], b[:n] = w.in_a.matmul(h), w.in_b.matmul(h)
        tails, states, y = scratch.tails, scratch.ssm, scratch.gdn_y
        for node in range(n):
            parent = scratch.parent_ids[node]
            tails[node][...] = tail if parent < 0 else tails[parent]
            states[node][...] = ssm if parent < 0 else states[parent]
            self._gdn_step(w, pre[node], tails[node], a[node], b[node], z[node], states[node], out=y[node])
        return w.out.matmul(y[:n])

    def _gdn_commit(self, i: int, w: _GDN, state: DeviceState, scratch: CudaTreeScratch,
                    path: Sequence[int], rows: Any = None) -> None:
        buf = scratch.buffers
        tail, ssm = state.buffers[f"layers.{i}.conv"], state.buffers[f"layers.{i}.ssm"]
        if self.FAST:  # replay the path's kept rows with the decode arithmetic (one launch)
            n = len(scratch.parent_ids)
            gdn_commit(scratch.gdn_rows(i, n), buf[f"{i}.pre"][:n], path, tail, ssm, path_device=rows)
            return
        pre, z, a, b = buf[f"{i}.pre"], buf[f"{i}.z"], buf[f"{i}.a"], buf[f"{i}.b"]
        for node in path:  # decode's step on the entry state; the output is not needed
            self._gdn_step(w, pre[node], tail, a[node], b[node], z[node], ssm, out=scratch.gdn_y[0])

    # ------------------------------------------------------------------------------------------ attention
    def _qkv(self, w: _Attn, h: Any) -> tuple[Any, Any, Any]:
        """qg [T, H, 2D] (q then gate per head), k, v [T, Hkv, D] projections (before norms and RoPE)."""
        hp, t = self.hp, int(h.shape[0])
        if w.proj is not None:
            qg, k, v = _cols(_mm(w.proj, h), w.proj.splits)
        else:
            qg, k, v = w.q.matmul(h), w.k.matmul(h), w.v.matmul(h)
        return (qg.reshape(t, hp.num_attention_heads, 2 * hp.head_dim),
                k.reshape(t, hp.num_key_value_heads, hp.head_dim), v.reshape(t, hp.num_key_value_heads, hp.head_dim))

    def _attn_step(self, i: int, w: _Attn, qg: Any, k: Any, v: Any, state: DeviceState, pos: int,
                   out: Any = None) -> Any:
        """One attention position: K/V row ``pos`` written (normed, rotated), rows 0..pos attended; [H·D]."""
        return attention_decode_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq, state.buffers[f"layers.{i}.k"],
                                     state.buffers[f"layers.{i}.v"], pos, self.eps, out=out)

    def _attn_decode(self, i: int, w: _Attn, h: Any, state: DeviceState, pos: int) -> Any:
        qg, k, v = self._qkv(w, h)
        kind = _kind(w.o) if self.FAST else None
        if kind is not None:  # the combine writes the o projection's split operand
            return self._out_proj(w.o, attention_decode_step(qg[0], k[0], v[0], w.q_norm, w.k_norm, self.inv_freq,
                                                             state.buffers[f"layers.{i}.k"],
                                                             state.buffers[f"layers.{i}.v"], pos, self.eps,
                                                             split=kind, fused=ATTN_FUSED))
        return w.o.matmul(self._attn_step(i, w, qg[0], k[0], v[0], state, pos)[None])

    def _attn_tokens(self, i: int, w: _Attn, h: Any, state: DeviceState, start: int) -> Any:
        qg, k, v = self._qkv(w, h)
        if self.FAST:  # flash-style causal prefill over the cache (cuda/attention_tree.cu)
            return _mm(w.o, attention_prefill_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq,
                                                   state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"],
                                                   start, self.eps, split=_kind(w.o)))
        y = cupy().empty((h.shape[0], qg.shape[1] * self.hp.head_dim), dtype=np.float32)
        for t in range(h.shape[0]):
            self._attn_step(i, w, qg[t], k[t], v[t], state, start + t, out=y[t])
        return w.o.matmul(y)

    def _attn_tree(self, i: int, w: _Attn, h: Any, state: DeviceState, scratch: CudaTreeScratch) -> Any:
        """Node i attends rows [0, P + depth_i] holding its path: ancestors' rows are rewritten from the scratch
        when a sibling branch took them (verify.py's ``owner`` walk)."""
        n, p, depths, parents = int(h.shape[0]), scratch.start, scratch.depths, scratch.parent_ids
        qg, k, v = self._qkv(w, h)
        kn, vn = scratch.buffers[f"{i}.k"], scratch.buffers[f"{i}.v"]
        kc, vc = state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"]
        if self.FAST:  # cache rows [0, P) + each node's ancestor rows from the scratch; the cache is not written
            _, _, dep_d, par_d = scratch.tables  # device copies: no upload per layer
            return self._out_proj(w.o, attention_tree_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq, kc, vc, p,
                                                           dep_d, par_d, self.eps, kn[:n], vn[:n], split=_kind(w.o)))
        owner = [-1] * (max(depths) + 1)  # which node's rows sit at cache row P + d
        y = scratch.attn_y
        for node in range(n):
            m = parents[node]
            while m >= 0:
                dm = depths[m]
                if owner[dm] != m:
                    kc[p + dm], vc[p + dm], owner[dm] = kn[m], vn[m], m
                m = parents[m]
            d = depths[node]
            self._attn_step(i, w, qg[node], k[node], v[node], state, p + d, out=y[node])
            owner[d] = node
            kn[node], vn[node] = kc[p + d], vc[p + d]  # the normed, rotated rows the step wrote
        return w.o.matmul(y[:n])

    def _attn_commit(self, i: int, state: DeviceState, scratch: CudaTreeScratch, rows: Any,
                     path: Sequence[int]) -> None:
        if self.FAST:
            attention_commit(state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"],
                             scratch.buffers[f"{i}.k"], scratch.buffers[f"{i}.v"], scratch.start, path, rows)
            return
        p, num = scratch.start, int(rows.shape[0])
        state.buffers[f"layers.{i}.k"][p:p + num] = scratch.buffers[f"{i}.k"][rows]
        state.buffers[f"layers.{i}.v"][p:p + num] = scratch.buffers[f"{i}.v"][rows]
