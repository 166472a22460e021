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
  projection (residual + the next layer's norm): 5 launches a GDN layer, 6 an attention layer. The first decode of
  a state records these launches (tandem/backend/cuda/plan.py); later steps replay them with prebuilt argument
  blocks, the token and the attention position passed as calls;
- ``prefill`` runs chunks of up to ``cuda_prefill.CHUNK_ROWS`` tokens on tensor cores (cuda_prefill.py: bf16
  GEMMs, flash attention, the GDN recurrent scan): deterministic and chunk-invariant, not decode's bits
  (``Capabilities.prefill_chunk_invariant``). Where that path cannot run (a projection without a GEMV format, a head
  size the flash kernel lacks, cuBLAS not row-invariant at a shape on this device, ``TC_PREFILL`` off) it runs
  pieces of ≤ GDN_CHUNK tokens with decode's arithmetic instead (the GEMVs, the GDN scan, attention_tree
  ``prefill_partial``), so a prefilled state equals a decoded one bit for bit (``prefill_matches_decode``);
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

The model is built in layers of files: cuda_layers.py (device weight dataclasses, the fused projections and the
operand helpers), cuda_layer_ops.py (``CudaLayerOps``: the layer loop and one small method a layer op:
``_gdn_decode``, ``_gdn_tokens``, ``_gdn_tree``, ``_gdn_commit``, ``_attn_decode``, ``_attn_tokens``, ``_attn_tree``,
``_attn_commit``, ``_mlp``), cuda_plans.py (``CudaPlannedVerbs``: the recorded decode, verify and commit) and this
file (``CudaQwen3_5Model``: the weights' upload, the verbs and the declared capabilities, tandem/models/protocol.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from tandem.backend.cuda.attention_decode import inv_freq
from tandem.backend.cuda.embed import embed_norm
from tandem.backend.cuda.gdn_seq import GDNRows, tree_plan
from tandem.backend.cuda.loader import cupy
from tandem.backend.cuda.plan import recordings as plan_recordings
from tandem.backend.cuda.token_reader import PendingToken, TokenReader
from tandem.backend.cuda.upload import CudaF32Linear, bf16_bits, to_device_linear
from tandem.backend.numpy_ops import GDN_CHUNK
from tandem.checkpoint import Checkpoint
from tandem.dtypes import KV_DTYPES
from tandem.models.device_state import DeviceState
from tandem.models.protocol import Capabilities
from tandem.models.qwen3_5.cuda_joint import CudaJointRounds
from tandem.models.qwen3_5.cuda_layers import _GDN, _Attn, _Layer, _fuse, _glu, _kind
from tandem.models.qwen3_5.cuda_plans import CudaPlannedVerbs
from tandem.models.qwen3_5.cuda_prefill import CHUNK_ROWS, TensorCorePrefill
from tandem.models.qwen3_5.cuda_scratch import CudaTreeScratch
from tandem.models.qwen3_5.hparams import HParams
from tandem.models.qwen3_5.host import HostModel
from tandem.models.qwen3_5.mrope import MultimodalRows
from tandem.models.qwen3_5.state_layout import check_ids, check_tree, state_specs
from tandem.models.qwen3_5.vision import VisionSide
from tandem.models.qwen3_5.weights import AttnWeights, GDNWeights, LayerWeights


def profile_key_for(device_name: str) -> str:
    """The price-profile key of a GPU named ``device_name``: "NVIDIA H200" -> ``cuda-nvidia-h200``."""
    return "cuda-" + (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu")


def profile_key() -> str:
    """The current GPU's price-profile key, e.g. ``cuda-nvidia-h200`` (profiles/<key>.json)."""
    props = cupy().cuda.runtime.getDeviceProperties(cupy().cuda.runtime.getDevice())
    return profile_key_for(props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]))


class CudaQwen3_5Model(CudaJointRounds, CudaPlannedVerbs):
    """Qwen3.5 dense text model on one GPU; the verbs and attributes the engine and speculator use.

    Args: host: the loaded host model (kept: its MTP head and hyper-parameters are shared); ckpt: the checkpoint
    the quantised weights' codes are read from (default: ``host.path`` opened; a tensor-parallel rank passes its
    ``ShardedCheckpoint``).
    Attributes: hp, host, path, head (device Linear [V, E]), layers, profile_device (price-profile key).
    Raises: ImportError without CuPy; ValueError for a Linear that cannot be uploaded.
    """

    FAST = True  # sequence / tree kernels and fused projections; False: the per-token reference composition
    JOINT = True  # joint_forward declared (cuda_joint.py): the engine's slots gather their rounds into one pass
    TC_PREFILL = True  # prefill on tensor cores where the model allows (cuda_prefill.py); False: decode's bits
    PREFILL_WEIGHTS = "auto"  # the tensor-core prefill's bf16 weights: "auto", "layer" (per call) or "resident"
    # The tensor-core prefill's GDN scan: "recurrent" (token by token) or "chunked" (WY form on tensor cores, 64-token
    # chunks on the position grid: Capabilities.prefill_grid = 64). Set before the model is built (capabilities).
    GDN_SCAN = "recurrent"
    # Decode and tree-verify attention over bf16 KV rows: "cuda_cores" (attn_partial / tree_partial, fp32 arithmetic)
    # or "tensor_cores" (attention_tc.py: MMA tiles of a KV head's query rows, q and the weights split into bf16 hi +
    # lo). Decode, verify, the joint pass and the MTP head follow it together (verify rows keep decode's bits either
    # way); fp32 KV keeps the cuda-core kernels. Faster at every context measured (docs/performance.md, "Attention at
    # depth"), not yet the default: with it on, the fallback prefill no longer computes decode's bits, and the GPU
    # suite has not run with it as the default. Set before the model is built (capabilities).
    DECODE_ATTENTION = "cuda_cores"
    _tc: TensorCorePrefill | None = None
    # The engine allocates this model's states at its context size and reuses one across sequences (reset in place):
    # a state's recorded launch plans (decode, each verify size, each commit length) point into its buffers, so a
    # state of its own for each request would record them all again (each recording costs many replays).
    reuses_states = True
    _draft_head: Any = None  # the device MTP head, uploaded by the first ``draft_heads``
    kv_dtype = "float32"  # the KV views' storage ("float32" / "bfloat16"): the host model's, read by new_state

    def __init__(self, host: HostModel, ckpt: Checkpoint | None = None) -> None:
        cp = cupy()
        self.host = host
        self.kv_dtype = host.kv_dtype
        self._rows: GDNRows | None = None  # GDN per-token rows for prefill pieces (allocated on first use)
        self._checked: set[str] = set()  # verbs whose launches ran once with every argument checked
        self._resid: tuple[Any, Any, str | None] | None = None  # inside _layers_fused: (residual, norm, split)
        self.hp: HParams = host.hp
        self.raw = host.raw
        self.path = host.path
        self.eps = float(host.hp.rms_norm_eps)
        if ckpt is None and host.path is not None:
            ckpt = Checkpoint.open(host.path)
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
        self.mrope_section = host.mrope_section
        # images in: the host's vision side moved here (its tower loads on the GPU; cuda_images.py feeds the verbs)
        host_vision = getattr(host, "vision", None)
        self.vision: VisionSide | None = host_vision.on_device("cuda") if host_vision is not None else None
        self.profile_device = profile_key()
        self.capabilities = self._capabilities()

    def tensor_core_prefill(self) -> TensorCorePrefill | None:
        """The tensor-core prefill (cuda_prefill.py) when this model can take it, else None (decode's arithmetic)."""
        if not self.TC_PREFILL or not self.FAST:
            return None
        if self._tc is None:
            self._tc = TensorCorePrefill(self, CHUNK_ROWS, self.PREFILL_WEIGHTS, self.GDN_SCAN)
        return self._tc if self._tc.ready else None

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
        model.mrope_section = (11, 11, 10)  # transformers' default (mrope.py); a state's rows carry their positions
        model.vision = None
        model.profile_device = profile_key()
        model.capabilities = model._capabilities()
        return model

    def _capabilities(self) -> Capabilities:
        """Everything the contract offers (tandem/models/protocol.py): tree verify, the MTP head, sampling on the
        device, launch-plan recordings, ``synchronize``; states reused across sequences; the recorded verify
        sizes and this GPU's price profile; a chunk-invariant prefill. On the tensor-core path prefill does not
        compute decode's bits; on the fallback path it does (the GEMVs are row-invariant, the GDN scan and the
        attention prefill run decode's arithmetic per row), so there a state taken after decode steps (a session
        snapshot) equals a cold prefill of the same tokens. The chunked GDN scan keeps the invariance for cuts at
        multiples of 64 (``prefill_grid``)."""
        tc = self.tensor_core_prefill()
        return Capabilities(tree_verify=True, draft_heads=True, device_sampling=True, plan_recordings=True,
                            synchronize=True, reuses_states=self.reuses_states, verify_sizes=self.verify_sizes,
                            profile_device=self.profile_device,
                            prefill_matches_decode=tc is None and not self._tc_decode_prefill_split(),
                            prefill_chunk_invariant=True,
                            prefill_grid=tc.grid if tc is not None else 0, kv_dtypes=KV_DTYPES,
                            joint_rounds=self.JOINT, vision=self.vision is not None)

    def _tc_decode_prefill_split(self) -> bool:
        """Whether decode runs the tensor-core attention while the fallback prefill keeps prefill_partial's
        cuda-core arithmetic (bf16 KV, ``DECODE_ATTENTION`` on, ``FAST``): prefill then does not compute decode's
        bits. Raises ValueError on an unknown DECODE_ATTENTION."""
        if self.DECODE_ATTENTION not in ("cuda_cores", "tensor_cores"):
            raise ValueError(f"DECODE_ATTENTION must be 'cuda_cores' or 'tensor_cores', got {self.DECODE_ATTENTION!r}")
        return self.FAST and self._tc_attention() and self.kv_dtype == "bfloat16"

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
        """A zeroed device state for a sequence of at most ``max_len`` tokens (the host model's buffer specs, KV views
        of ``kv_dtype``)."""
        return DeviceState(state_specs(self.hp, max_len, self.kv_dtype), max_len)

    def new_tree_scratch(self, max_nodes: int) -> CudaTreeScratch:
        """Per-sequence verify/commit device buffers for trees of at most ``max_nodes`` nodes (allocated once)."""
        return CudaTreeScratch(self.hp, max_nodes, per_node_states=not self.FAST, kv_dtype=self.kv_dtype)

    def draft_heads(self) -> Any:
        """The checkpoint's MTP head on the device (tandem/models/qwen3_5/cuda_mtp.py, uploaded on first use from
        the host model's); None if the checkpoint has none, or for a model built ``from_parts`` without one."""
        head = self._draft_head
        if head is None and self.host is not None:
            host_head = self.host.draft_heads()
            if host_head is not None:
                from tandem.models.qwen3_5.cuda_mtp import CudaMTPHead

                ckpt = Checkpoint.open(self.path) if self.path is not None else None
                head = self._draft_head = CudaMTPHead.upload(self, host_head, ckpt)
        return head

    def image_spec(self) -> Any:
        """(ImageSpec, image pad id) of the checkpoint's vision tower, or None (none, or ``--vision off``)."""
        return self.vision.spec() if self.vision is not None else None

    def set_vision_mode(self, mode: str) -> None:
        """``--vision``: "auto", "on" (load the tower onto the GPU now) or "off" (VisionSide.set_mode). Raises:
        ValueError, CheckpointError."""
        if self.vision is None:
            raise ValueError("this model reads no images (built without a checkpoint)")
        self.vision.set_mode(mode)

    def image_rows(self, ids: Sequence[int], images: Sequence[Any]) -> MultimodalRows:
        """The rows of a prompt with its pads expanded for ``state.multimodal`` (mrope.py): 3-D positions on the
        host, the tower's features on the device (vision.py on CuPy). Raises: ValueError (pads and images disagree,
        no vision), CheckpointError."""
        if self.vision is None:
            raise ValueError("this model reads no images (built without a checkpoint)")
        return self.vision.rows(ids, images)

    def synchronize(self) -> None:
        """Wait for the device's queued work (for timing: the verbs return before the GPU finishes)."""
        cupy().cuda.get_current_stream().synchronize()

    # ------------------------------------------------------------------------------------------ hot verbs
    def prefill(self, state: DeviceState, ids: Sequence[int], all_logits: bool = False,
                hidden_out: list[np.ndarray] | None = None) -> Any:
        """Run ``ids`` at positions state.length.. and append them to the state.

        On the tensor-core path (``tensor_core_prefill``) in chunks of up to CHUNK_ROWS tokens ending on its grid:
        the bits depend on the tokens alone, not on the chunks nor on how the prompt was split into calls (with the
        chunked GDN scan: into calls cut at multiples of 64, ``Capabilities.prefill_grid``). Otherwise in pieces ending
        at absolute multiples of GDN_CHUNK with decode's bits for every token.
        Returns: logits [V] float32 (device) of the last token, or [T, V] with ``all_logits``. With
        ``hidden_out``, host post-final-norm hidden states [piece, E] float32 are appended (the MTP input).
        Raises: ValueError if ids is empty, holds an id outside the vocabulary or overflows the state.
        """
        check_ids(self.hp, state, ids)
        cp = cupy()
        logits: list[Any] = []
        last: Any = None  # [piece, E] hidden of the latest piece
        base = pos = state.length
        end = base + len(ids)
        tc = self.tensor_core_prefill()
        while pos < end:
            if tc is not None:
                stop = min(end, pos + tc.chunk_rows)
                if stop < end and stop // tc.grid * tc.grid > pos:  # chunks end on the scan's grid
                    stop = stop // tc.grid * tc.grid
                with self._launch_checks("prefill_tc"):
                    last = tc.forward(state, ids[pos - base:stop - base], pos)
            else:
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
        check_ids(self.hp, state, [tid])  # a device id: 0 stands in (capacity)
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

    def verify_tree(self, state: DeviceState, scratch: CudaTreeScratch, token_ids: Sequence[int],
                    parent_ids: Sequence[int]) -> Any:
        """Run a draft tree after the committed tokens (tandem/models/qwen3_5/verify.py's contract).

        Args: state: its length P is the root's position; attention rows ≥ P are scratch until commit, sections
        are read only. scratch: ``new_tree_scratch``. token_ids, parent_ids: [N], node 0 the root (-1).
        Returns: logits [N, V] float32 (device); row i has the bits of a plain decode of node i after its path.
        Raises: ValueError on a malformed tree, a bad id, too many nodes or a tree past the state's end.
        """
        depths = check_tree(self.hp, state, scratch.max_nodes, token_ids, parent_ids)
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
    # recorded plan for each instead of recording again whenever the size moves (a recording costs several replays'
    # host time; each plan holds a memory pool that grows with the node count). Other sizes (a tree smaller than any)
    # still take a plan.
    verify_sizes = (2, 3, 4, 6, 8, 12, 16, 24, 32)

    @property
    def plan_recordings(self) -> int:
        """Launch plans recorded so far in this process (tandem/backend/cuda/plan.py ``recordings``; the MTP head's
        included): the engine leaves a round whose count moved out of StairCut's prices, since a recording costs
        far more host time than the replays it prices."""
        return plan_recordings()

    def commit(self, state: DeviceState, scratch: CudaTreeScratch, path: Sequence[int]) -> None:
        """Append the accepted ``path`` (root-to-node chain of the last verify) to the state, with the bits of
        decoding its tokens one by one. Raises: ValueError for a bad path or a state moved since verify."""
        check_commit_path(state.length, scratch, path)
        if self.FAST and self._plannable():
            self._commit_planned(state, scratch, path)
        else:
            self._commit_layers(state, scratch, path)
        state.length += len(path)

    def _commit_layers(self, state: DeviceState, scratch: CudaTreeScratch, path: Sequence[int]) -> None:
        """The accepted path's rows into the state layer by layer (one commit launch a layer, no launch plan);
        ``state.length`` is the caller's to advance."""
        rows = cupy().asarray(np.asarray(path, dtype=np.int32))  # one upload for every layer
        with self._launch_checks("commit"):
            for i, lw in enumerate(self.layers):
                if isinstance(lw.mixer, _Attn):
                    self._attn_commit(i, state, scratch, rows, path)
                else:
                    self._gdn_commit(i, lw.mixer, state, scratch, path, rows)


def check_commit_path(length: int, scratch: CudaTreeScratch, path: Sequence[int]) -> None:
    """Raise ValueError unless a state of ``length`` tokens is where ``scratch``'s last verify started and ``path``
    is a root-to-node chain of that tree."""
    if length != scratch.start:
        raise ValueError(f"state length {length} differs from the verified tree's start {scratch.start}")
    n = len(scratch.parent_ids)
    if not path or path[0] != 0 or any(not 0 <= p < n for p in path) \
            or any(scratch.parent_ids[path[j]] != path[j - 1] for j in range(1, len(path))):
        raise ValueError(f"path {list(path)} is not a root-to-node chain of the verified tree")


if TYPE_CHECKING:  # mypy checks the adapter against the model contract (tandem/models/protocol.py)
    from tandem.models.protocol import (ChainingDraftHead, DeviceSampler, DraftHeadSource, PlanRecorder,
                                        SpeculativeModel, Synchronizer, VisionModel)
    from tandem.models.qwen3_5.cuda_mtp import CudaMTPHead

    def _satisfies_the_contract(model: CudaQwen3_5Model, head: CudaMTPHead) -> None:
        as_model: SpeculativeModel[DeviceState, CudaTreeScratch] = model
        as_source: DraftHeadSource = model
        as_sampler: DeviceSampler[DeviceState] = model
        as_recorder: PlanRecorder = model
        as_sync: Synchronizer = model
        as_head: ChainingDraftHead = head
        as_vision: VisionModel = model
        del as_model, as_source, as_sampler, as_recorder, as_sync, as_head, as_vision
