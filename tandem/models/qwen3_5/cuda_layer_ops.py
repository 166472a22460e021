"""The CUDA Qwen3.5 model's layer loop and layer ops: one small method per op (``_gdn_decode``, ``_gdn_tokens``,
``_gdn_tree``, ``_gdn_commit``, ``_attn_decode``, ``_attn_tokens``, ``_attn_tree``, ``_attn_commit``, ``_mlp``), the
plain loop (``_layers``: an add_rms_norm launch per norm) and the fused one (``_layers_fused``: each residual add and
norm in the epilogue of the GEMV before it), the same bits. ``CudaLayerOps`` is the base of the model class
(cuda_model.py ``CudaQwen3_5Model``), which owns the weights and the verbs; the arithmetic contract is in
cuda_model.py's module docstring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda import gemv
from tandem.backend.cuda.arrays import checked_once
from tandem.backend.cuda.attention_switch import attention_decode_step, attention_tree_step
from tandem.backend.cuda.attention_flash import attention_flash_prefill
from tandem.backend.cuda.embed import embed
from tandem.backend.cuda.attention_tree import attention_commit, attention_prefill_step
from tandem.backend.cuda.gdn_seq import GDNRows, gdn_commit, gdn_decode, gdn_prefill, gdn_tree, new_rows
from tandem.backend.cuda.gdn_step import gdn_decode_step
from tandem.backend.cuda.loader import cupy, persistent
from tandem.backend.cuda.rms_norm import add_rms_norm, rms_norm
from tandem.backend.cuda.silu_mul import silu_mul
from tandem.backend.numpy_ops import GDN_CHUNK
from tandem.models.device_state import DeviceState
from tandem.models.qwen3_5.cuda_images import chunk_mrope, place_features, rope_shift
from tandem.models.qwen3_5.cuda_layers import _GDN, _Attn, _Layer, Mixer, _cols, _kind, _mm
from tandem.models.qwen3_5.cuda_scratch import CudaTreeScratch
from tandem.models.qwen3_5.hparams import HParams

# Attention decode in one launch (the last partial block combines) or two (partials, then a combine block per
# head): two measured faster at 27B shapes (bench/fusion.py), so decode takes two.
ATTN_FUSED = False
# Verifies of at most ``_fused_rows()`` nodes (4 with the fp16 operand kinds of FP8 / NVFP4, 2 with BF16's) take the
# decode's fused layer loop (``_layers_fused``): each residual add and norm in the epilogue of the GEMV before it
# (gemv ``matmul_residual_norm`` on T rows) instead of an add_rms_norm launch each, the same bits.
VERIFY_FUSED = True


class CudaLayerOps:
    """The layer loop and layer ops of ``CudaQwen3_5Model`` over its device weights (see the module docstring)."""

    FAST: bool  # sequence / tree kernels and fused projections (the model class sets it)
    DECODE_ATTENTION: str  # "cuda_cores" or "tensor_cores": decode and verify attention (the model class sets it)
    hp: HParams
    eps: float
    inv_freq: Any  # [rd/2] float32 (device)
    mrope_section: tuple[int, int, int]  # the 3-D rotary split of image prompts' rows (mrope.py)
    embed_bits: Any  # [V, E] uint16 (BF16) or None
    embed_f32: Any  # [V, E] float32 or None
    head: Any  # device Linear [V, E]
    norm: Any  # [E] float32
    layers: list[_Layer]
    _rows: GDNRows | None  # GDN per-token rows for prefill pieces (allocated on first use)
    _resid: tuple[Any, Any, str | None] | None  # inside _layers_fused: (residual, norm, split)
    _checked: set[str]  # verbs whose launches ran once with every argument checked
    _plannable_cache: bool | None = None
    _fusable_cache: bool | None = None
    _fused_rows_cache: int | None = None

    def _plannable(self) -> bool:
        """Whether every launch of decode / verify goes through the kernel launchers, which a LaunchPlan records:
        the BF16 embedding kernel and every Linear a GEMV of tandem/backend/cuda/gemv.py (the fp32 fallback
        Linear runs cuBLAS and CuPy copies, which a plan would not replay)."""
        cached = self._plannable_cache
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
        cached = self._fusable_cache
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

    def _launch_checks(self, verb: str) -> contextlib.AbstractContextManager[None]:
        """The first call of a verb checks every kernel argument (tandem.backend.cuda.arrays.require); later calls
        build the same arguments and skip the checks (about a microsecond of host time per launch;
        ``arrays.checked_once``). The verbs' own input checks (ids, state capacity, tree shape) always run."""
        return checked_once(self._checked, verb)

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
        cached = self._fused_rows_cache
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
        """Post-final-norm hidden [T, E] of tokens at start..start+T-1, layer by layer, token steps inside. An image
        prompt's rows (``state.multimodal``, cuda_images.py): its features at the pads, its 3-D rotary positions."""
        mrope = chunk_mrope(state, start, len(ids), self.mrope_section)

        def mixer(i: int, lw: _Layer, h: Any) -> Any:
            if isinstance(lw.mixer, _Attn):
                return self._attn_tokens(i, lw.mixer, h, state, start, mrope)
            return self._gdn_tokens(i, lw.mixer, h, state)

        x = self._embed(ids)
        place_features(x, state, start)
        return self._layers(x, mixer)

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

    def _tc_attention(self) -> bool:
        """Whether decode and verify attention run on tensor cores (``DECODE_ATTENTION``; bf16 KV caches only, the
        launchers keep today's kernels for fp32 rows). Decode, verify, the joint pass and the MTP head follow it
        together, so verify rows keep decode's bits either way."""
        return self.DECODE_ATTENTION == "tensor_cores"

    def _attn_step(self, i: int, w: _Attn, qg: Any, k: Any, v: Any, state: DeviceState, pos: int,
                   out: Any = None) -> Any:
        """One attention position: K/V row ``pos`` written (normed, rotated: at pos + the state's rotary shift,
        cuda_images.rope_shift), rows 0..pos attended; [H·D]."""
        return attention_decode_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq, state.buffers[f"layers.{i}.k"],
                                     state.buffers[f"layers.{i}.v"], pos, self.eps, out=out,
                                     rope_shift=rope_shift(state, pos),
                                     tensor_cores=self._tc_attention())

    def _attn_decode(self, i: int, w: _Attn, h: Any, state: DeviceState, pos: int) -> Any:
        qg, k, v = self._qkv(w, h)
        kind = _kind(w.o) if self.FAST else None
        if kind is not None:  # the combine writes the o projection's split operand
            return self._out_proj(w.o, attention_decode_step(qg[0], k[0], v[0], w.q_norm, w.k_norm, self.inv_freq,
                                                             state.buffers[f"layers.{i}.k"],
                                                             state.buffers[f"layers.{i}.v"], pos, self.eps,
                                                             split=kind, fused=ATTN_FUSED,
                                                             rope_shift=rope_shift(state, pos),
                                                             tensor_cores=self._tc_attention()))
        return w.o.matmul(self._attn_step(i, w, qg[0], k[0], v[0], state, pos)[None])

    def _attn_tokens(self, i: int, w: _Attn, h: Any, state: DeviceState, start: int, mrope: Any = None) -> Any:
        """T prompt tokens of an attention layer with decode's arithmetic; ``mrope``: an image prompt's rows
        (vision_mrope.MRopeRows of these T rows; the prefill kernels rotate each at its 3-D position)."""
        qg, k, v = self._qkv(w, h)
        if self.FAST or mrope is not None:  # causal prefill over the cache with decode's bits (cuda/attention_tree.cu)
            if not self.FAST:  # the per-token composition has no 3-D step: the prefill launcher serves it
                return w.o.matmul(attention_prefill_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq,
                                                         state.buffers[f"layers.{i}.k"],
                                                         state.buffers[f"layers.{i}.v"], start, self.eps,
                                                         mrope=mrope))
            return _mm(w.o, attention_prefill_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq,
                                                   state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"],
                                                   start, self.eps, split=_kind(w.o), mrope=mrope))
        y = cupy().empty((h.shape[0], qg.shape[1] * self.hp.head_dim), dtype=np.float32)
        for t in range(h.shape[0]):
            self._attn_step(i, w, qg[t], k[t], v[t], state, start + t, out=y[t])
        return w.o.matmul(y)

    def _attn_tokens_flash(self, i: int, w: _Attn, h: Any, state: DeviceState, start: int) -> Any:
        """T tokens of an attention layer with the tensor-core prefill's flash attention (attention_flash.py) and the
        o projection's GEMV: the MTP head's catch-up over a prompt beside the tensor-core prefill (chunk-invariant,
        not decode's bits)."""
        qg, k, v = self._qkv(w, h)
        return _mm(w.o, attention_flash_prefill(qg, k, v, w.q_norm, w.k_norm, self.inv_freq,
                                                state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"],
                                                start, self.eps, split=_kind(w.o)))

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
                                                           dep_d, par_d, self.eps, kn[:n], vn[:n], split=_kind(w.o),
                                                           rope_shift=rope_shift(state, p, max(depths) + 1),
                                                           tensor_cores=self._tc_attention()))
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
