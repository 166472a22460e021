"""The Qwen3.5 MTP head on the GPU: the MTP drafter's steps run where the target's weights are.

The arithmetic is tandem/models/qwen3_5/mtp.py's (spec/qwen3_5.md §2.4, §8): one draft row for a token x at
position t with a hidden state h
    u = fc( concat[ pre_fc_norm_embedding(embed[x]), pre_fc_norm_hidden(h) ] )
    u = u + attention(input_layernorm(u)) at t   (the head's own KV cache)
    u = u + mlp(post_attention_layernorm(u));   y = mtp.norm(u);   logits = lm_head(y)
through the CUDA model's own kernels and layer ops (``CudaQwen3_5Model._norm``, ``_attn_decode`` /
``_attn_tokens``, ``_mlp``): the MTP layer is uploaded as one more full-attention layer, the embedding and the
head are the target's. Drafts only need to be good guesses (the verify decides every committed token), so the
head is close to the host head (its GEMVs' fp16 hi + lo operands, the kernels' summation orders), not bitwise.
``top_probs`` picks the draft's best ids on the device (cuda/argmax.cu top_k): 2 + 2k words a step cross to the
host, not the vocabulary's logits.
A single row (each step of a draft chain, and the catch-up of one accepted token) runs through a LaunchPlan per head
state (tandem/backend/cuda/plan.py, as the model's decode): recorded once, then replayed with the token (the
embedding + norm kernel) and the position (the attention) set per call; ``top_probs`` on that row's output replays
a second plan (the head GEMV and top_k) per k. The same arithmetic, so the bits of the unplanned row (its embedding
and first norm are one launch, embed.embed_norm, with the bits of embed then rms_norm). ``chain`` runs a whole draft
chain that way with one host read: each row's embedding reads the previous row's best id on the device.

Why on the GPU: on the host the head reads its weights and the [V, E] lm_head from host memory each draft step
(at 27B about 1.7 G parameters a step), which costs far more than a verify saves.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tandem.backend.cuda import gemv
from tandem.backend.cuda.argmax import TOP_K_MAX, top_k, unpack_top_k
from tandem.backend.cuda.attention_decode import decode_scratch
from tandem.backend.cuda.embed import EmbedNormStep
from tandem.backend.cuda.loader import cupy
from tandem.backend.cuda.plan import LaunchPlan
from tandem.backend.cuda.rms_norm import rms_norm
from tandem.models.device_state import DeviceState
from tandem.models.state import BufferSpec

LAYER = 0  # the head's attention layer's index in its state's buffer names (layers.0.k / layers.0.v)


class CudaMTPHead:
    """The MTP head of a ``CudaQwen3_5Model`` (the drafter's ``new_state`` / ``forward`` / ``logits`` /
    ``top_probs``, as tandem/models/qwen3_5/mtp.py's ``MTPHead``).

    Args: model: the CUDA model (embedding, lm_head, layer ops). norm_embedding, norm_hidden, norm: [E] float32
    device arrays (1 + w); fc: a device Linear [E, 2E]; layer: the MTP decoder layer as ``CudaQwen3_5Model._layer``
    builds it (a full-attention layer).
    """

    PLANNED = True  # single rows through launch plans where every launch can be recorded (False: the launchers)
    max_top_k = TOP_K_MAX  # the most ids ``top_probs`` returns (MTPDrafter caps its branching at it)
    chains = True  # ``chain``: a draft chain on the device with one host read

    def __init__(self, model: Any, norm_embedding: Any, norm_hidden: Any, fc: Any, layer: Any, norm: Any) -> None:
        self.model = model
        self.norm_embedding, self.norm_hidden, self.norm = norm_embedding, norm_hidden, norm
        self.fc = fc
        self.layer = layer
        self._plannable_cache: bool | None = None
        self._last_plan: LaunchPlan | None = None  # the plan of the latest planned row (its output: top_probs' input)

    @classmethod
    def upload(cls, model: Any, host_head: Any, ckpt: Any) -> "CudaMTPHead":
        """The host ``MTPHead``'s weights on the device (``model._layer`` for the layer: its projections fused as
        the target's). Raises: ValueError for a Linear that cannot be uploaded."""
        w = host_head.weights
        return cls(model, model._f32(w.norm_embedding), model._f32(w.norm_hidden), model._upload(w.fc, ckpt),
                   model._layer(w.layer, ckpt), model._f32(w.norm))

    def new_state(self, max_len: int) -> DeviceState:
        """The head's KV cache: ``layers.0.k`` / ``layers.0.v`` [max_len, Hkv, D] on the device (zeroed), in the
        target's ``kv_dtype``."""
        hp, kv = self.model.hp, self.model.kv_dtype
        shape = (max_len, hp.num_key_value_heads, hp.head_dim)
        return DeviceState([BufferSpec(f"layers.{LAYER}.k", shape, kv, "view"),
                            BufferSpec(f"layers.{LAYER}.v", shape, kv, "view")], max_len)

    def forward(self, state: DeviceState, token_ids: Sequence[int], hidden: Any, start: int) -> Any:
        """Rows at positions start..start+T-1 (causal among themselves, after cache rows 0..start-1).

        Args: token_ids: [T] (token_{t+1} for row t); hidden: [T, E] float32, host or device (h_t).
        Returns: the head's output hidden states [T, E] float32 on the device (post ``mtp.norm``; for a planned single
        row the plan's buffer, overwritten by the next single row on this state). Writes cache rows
        start..start+T-1; sets state.length to start + T.
        Raises: ValueError when the rows do not fit the state, an id is outside the vocabulary or the shapes
        disagree.
        """
        m, cp = self.model, cupy()
        t = len(token_ids)
        if t < 1:
            raise ValueError("MTP forward: no token ids")
        self._check_rows(state, start, t, token_ids, hidden)
        if t == 1 and self._plannable():
            return self._row_planned(state, int(token_ids[0]), hidden, start)
        self._last_plan = None
        h = cp.ascontiguousarray(cp.asarray(hidden, dtype=cp.float32))
        e = m._norm(m._embed(list(token_ids)), None, self.norm_embedding, None)
        u = self.fc.matmul(cp.concatenate([e, m._norm(h, None, self.norm_hidden, None)], axis=1))
        lw = self.layer
        a = m._norm(u, None, lw.input_norm, lw.mixer.proj)
        if t == 1:
            a = m._attn_decode(LAYER, lw.mixer, a, state, start)
        elif m.tensor_core_prefill() is not None and lw.mixer.proj is not None:  # beside the tensor-core prefill
            a = m._attn_tokens_flash(LAYER, lw.mixer, a, state, start)
        else:
            a = m._attn_tokens(LAYER, lw.mixer, a, state, start)
        a = m._mlp(lw, m._norm(u, a, lw.post_norm, lw.gate_up))  # u += attention
        state.length = start + t
        return m._norm(u, a, self.norm, None)  # u += mlp, then mtp.norm (fp32: the next step's h)

    def _check_rows(self, state: DeviceState, start: int, rows: int, token_ids: Sequence[int], hidden: Any) -> None:
        """Raises ValueError unless rows start..start+rows-1 fit the state, every id is an integer in the vocabulary
        and ``hidden`` is [len(token_ids), E] (``forward``'s and ``chain``'s arguments)."""
        m = self.model
        if start < 0 or start + rows > state.max_len:
            raise ValueError(f"MTP rows {start}..{start + rows - 1} outside its cache of {state.max_len}")
        vocab = int(m.hp.vocab_size)
        if any(not isinstance(i, (int, np.integer)) or not 0 <= i < vocab for i in token_ids):
            raise ValueError(f"MTP token ids must be integers in [0, {vocab})")
        if tuple(hidden.shape) != (len(token_ids), m.hp.hidden_size):
            raise ValueError(f"hidden: expected {[len(token_ids), m.hp.hidden_size]}, got {list(hidden.shape)}")

    def _plannable(self) -> bool:
        """Whether a row's launches can all be recorded: the model's (its ``_plannable``: the BF16 embedding, GEMVs
        of gemv.py) and the head's Linears GEMVs of gemv.py too."""
        if self._plannable_cache is None:
            m, lw = self.model, self.layer
            w = lw.mixer
            lins = [self.fc, w.proj, w.q, w.k, w.v, w.o, lw.gate_up, lw.gate, lw.up, lw.down]
            gemvs = (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear)
            self._plannable_cache = bool(m.FAST and m._plannable()) and \
                all(lin is None or isinstance(lin, gemvs) for lin in lins)
        return self.PLANNED and self._plannable_cache

    def _row_planned(self, state: DeviceState, token: int | Any, hidden: Any, pos: int) -> Any:
        """One row through the state's LaunchPlan (recorded by the first row, replayed after: the hidden row copied
        into the plan's input buffer, the token and position set per call). ``token``: a host id (checked by the
        caller) or an int32 [1] device array the embedding kernel reads (kept alive by the caller until the row has
        run). Returns the plan's output [1, E] float32, overwritten by the next planned row on this state."""
        cp = cupy()
        plan: LaunchPlan | None = state.decode_plan
        if plan is not None and plan.vars.get("head") is self:
            h_in = plan.vars["h_in"]
            if isinstance(hidden, np.ndarray):
                h_in.set(np.ascontiguousarray(hidden, dtype=np.float32))
            elif hidden is not h_in:
                cp.copyto(h_in, hidden.reshape(h_in.shape))
            plan.vars["token"], plan.vars["pos"] = token, pos
            plan.replay()
        else:
            plan = self._record(state, token, hidden, pos)
        self._last_plan = plan
        state.length = pos + 1
        return plan.outputs[0]

    def _record(self, state: DeviceState, token: int | Any, hidden: Any, pos: int) -> LaunchPlan:
        """Run one row while recording its launches into a new plan (state.decode_plan, set once the recording
        succeeded): the embedding + norm (EmbedNormStep: the bits of the unplanned row's embed then rms_norm) and the
        attention (the model's ``_attn_decode_planned``) as calls, the rest the unplanned row's launches."""
        m, cp = self.model, cupy()
        e, lw = int(m.hp.hidden_size), self.layer
        plan = LaunchPlan()
        plan.vars = {"head": self, "token": token, "pos": pos, "top": {}}
        vars_ = plan.vars
        kc, vc = state.buffers[f"layers.{LAYER}.k"], state.buffers[f"layers.{LAYER}.v"]
        with plan.record(), m._launch_checks("mtp"):
            h_in = cp.empty((1, e), dtype=cp.float32)
            cp.copyto(h_in, cp.asarray(hidden, dtype=cp.float32).reshape(1, e))
            both = cp.empty((2, e), dtype=cp.float32)  # = [1, 2E]: the normed embedding row, then the normed h
            x = cp.empty((1, e), dtype=cp.float32)  # the raw embedding row (unused)
            step = EmbedNormStep(m.embed_bits, self.norm_embedding, m.eps, x, out=both[0:1])
            plan.add_call(lambda: step(vars_["token"]))
            rms_norm(h_in, self.norm_hidden, m.eps, out=both[1:2])
            u = self.fc.matmul(both.reshape(1, 2 * e))
            a = m._norm(u, None, lw.input_norm, lw.mixer.proj)
            a = m._attn_decode_planned(plan, lw.mixer, a, kc, vc, decode_scratch(kc, m.hp.num_attention_heads))
            a = m._mlp(lw, m._norm(u, a, lw.post_norm, lw.gate_up))
            out = m._norm(u, a, self.norm, None)
        vars_["h_in"] = h_in
        plan.outputs = (out,)
        state.decode_plan = plan
        return plan

    def logits(self, hidden: Any) -> Any:
        """The target's lm_head over the head's output hidden states: [T, E] -> [T, V] float32 (device)."""
        return self.model.head.matmul(hidden)

    def top_probs(self, hidden: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best ``min(k, TOP_K_MAX)`` next ids after the last row of ``hidden`` [T, E] and their softmax
        probabilities over the whole vocabulary: (ids [k'] int64, best logit first, ties to the smaller id, a NaN
        first; probs [k'] float64; past the vocabulary's size id 0x7FFFFFFF with probability 0). One host read of
        2 + 2k' words. Raises: ValueError for k < 1."""
        if k < 1:
            raise ValueError(f"k must be ≥ 1, got {k}")
        k = min(k, TOP_K_MAX)
        ids, probs, _ = unpack_top_k(cupy().asnumpy(self._top_packed(hidden, k)), k)
        return ids[0].astype(np.int64), probs[0]

    def _top_packed(self, hidden: Any, k: int) -> Any:
        """``top_k`` of the last row of ``hidden`` on the device: packed int32 [1, 2 + 2k] (argmax.top_k's layout).
        For the latest planned row, the buffer of its top-k plan (replayed; recorded at the first call per k),
        overwritten by the next replay."""
        row = self._last_plan
        if row is not None and hidden is row.outputs[0]:  # the latest planned row: its own top-k plan
            tops: dict[int, LaunchPlan] = row.vars["top"]
            plan = tops.get(k)
            if plan is None:
                plan = LaunchPlan()
                with plan.record(), self.model._launch_checks("mtp"):
                    plan.outputs = top_k(self.logits(hidden), k)
                tops[k] = plan  # kept once recorded
            else:
                plan.replay()
            return plan.outputs
        return top_k(self.logits(hidden[-1:]), k)

    def chain(self, state: DeviceState, root: int, hidden: Any, start: int, steps: int,
              k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A draft chain run on the device with one host read: row s (position start + s) takes the previous row's
        best id straight from its top-k result on the device (row 0 takes ``root``) and the previous row's output
        hidden state; each row's best ``min(k, TOP_K_MAX)`` ids and probabilities are read once, at the end. The
        rows and ids are those of ``steps`` calls of ``forward`` (T = 1) then ``top_probs`` feeding the best id
        back (the same planned launches: the embedding kernel reads the id from device memory instead of its
        argument), without a host round trip between rows.

        Args: root: the first row's token id; hidden: [1, E] float32, host or device (the first row's h); start: the
        first row's position; steps ≥ 1; k ≥ 1.
        Returns: (ids [steps, k'] int64, probs [steps, k'] float64), as ``top_probs`` row by row; None where single
        rows are not planned (``PLANNED`` False, or a model whose launches cannot be recorded) or where the lm_head
        has rows past the vocabulary or the embedding (a best id there would reach the embedding kernel unchecked;
        ``forward`` refuses it): the caller then runs the rows one by one. Writes cache rows start..start+steps-1;
        sets state.length to start + steps.
        Raises: ValueError for steps < 1, k < 1, rows outside the state, a root outside the vocabulary or a bad
        hidden shape.
        """
        if steps < 1 or k < 1:
            raise ValueError(f"steps and k must be ≥ 1, got {steps}, {k}")
        m, cp = self.model, cupy()
        if not self._plannable() or int(m.head.shape[0]) > min(int(m.hp.vocab_size), int(m.embed_bits.shape[0])):
            return None
        self._check_rows(state, start, steps, [root], hidden)
        k = min(k, TOP_K_MAX)
        width = 2 + 2 * k
        picks = cp.empty((steps, width), dtype=cp.int32)  # each row's packed top-k; column 2 is its best id
        token: Any = int(root)
        h = hidden
        for s in range(steps):
            h = self._row_planned(state, token, h, start + s)
            packed = self._top_packed(h, k)
            picks[s:s + 1].data.copy_from_device_async(packed.data, 4 * width)
            token = picks[s, 2:3]  # int32 [1] on the device: the next row's embedding reads it there
        ids, probs, _ = unpack_top_k(cp.asnumpy(picks), k)  # the one host read (it waits for the chain)
        return ids.astype(np.int64), probs
