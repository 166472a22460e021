"""The CUDA Qwen3.5 model's joint forward pass: several sequences' decode steps and verify trees in one pass over
the weights (``JointForward.joint_forward``, tandem/models/protocol.py; driven by the engine's slots,
tandem/slots.py ``JointRounds``).

The rows of every item (one for a decode step, N for a verify tree) are stacked into one residual stream [R, E]:
the embedding, every norm, every projection GEMV (each weight read once for all R rows), the MLP and the head run
on all rows at once; per item, the attention layers run ``attention_decode_step`` (a decode: its KV row written at
its position) or ``attention_tree_step`` (a verify: its tree over its cache), and the GDN layers ``gdn_decode`` (the
state and conv tail updated in place) or ``gdn_tree`` (its scratch rows), each writing its rows of the joint split
operand of the output projection.

Exactness: the GEMVs are row-invariant (a row's bits do not depend on the other rows nor on their count: the
verify rows equal decode rows, tests/test_cuda_gemv.py), the norms and the MLP's epilogues are row-wise, and each
item's attention and recurrent kernels are the ones its ``decode`` / ``verify_tree`` runs, over its own state. So
an item's logits, state and scratch equal, bit for bit, those of the same call alone (tests/test_cuda_joint.py),
which is what makes a request's tokens independent of the other requests running beside it.

With ``JOINT_PLANNED`` (the default) a pass of decode steps only (plain rounds) runs through a LaunchPlan recorded per set of states
(tandem/backend/cuda/plan.py, as the decode's own plan): the ids uploaded and each attention layer's steps called at
their positions, everything else replayed; the same kernels and arguments, so the same bits. Otherwise, and for
passes with a verify tree, the launchers run directly.

With ``JOINT_BATCHED`` (the default) the decode rows of a pass of decode rows only, planned or not, share their
attention and GDN launches: one attention launch a layer for every slot (two where a combine runs apart) and two GDN launches, over a
device table of the slots' state buffers built once per set of states (cuda_joint_slots.py, decode_slots.py), each
slot's blocks running its own decode's arithmetic with its own buffers (the same bits as the per-slot launches).
The tensor-core attention keeps the per-slot loop; verify trees keep their per-part launches, and so do decode rows
in a pass with a tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda.attention_decode import decode_scratch
from tandem.backend.cuda.attention_switch import attention_decode_step, attention_tree_step, decode_step
from tandem.backend.cuda.embed import embed
from tandem.backend.cuda.gdn_seq import gdn_decode, gdn_tree, tree_plan
from tandem.backend.cuda.operand import PARTS
from tandem.backend.cuda.loader import cupy, persistent
from tandem.backend.cuda.plan import LaunchPlan
from tandem.backend.cuda.token_reader import PendingToken
from tandem.models.protocol import JointItem, run_items_alone
from tandem.models.qwen3_5.cuda_images import rope_shift
from tandem.models.qwen3_5.cuda_joint_slots import SlotKernels, slot_kernels
from tandem.models.qwen3_5.cuda_layer_ops import ATTN_FUSED, CudaLayerOps
from tandem.models.qwen3_5.cuda_layers import _GDN, _Attn, _Layer, _kind
from tandem.models.qwen3_5.state_layout import check_ids, check_tree

JOINT_ROWS = 32  # the most rows one pass takes (the verify GEMVs' row count); more items run as further passes
MAX_JOINT_PLANS = 8  # recorded joint decode plans kept (one per set of states; least recently used dropped)


class _Part:
    """An item placed in the pass: rows r0..r1 of the residual stream."""

    def __init__(self, index: int, item: JointItem, r0: int, r1: int, ids: list[int]) -> None:
        self.index, self.item, self.r0, self.r1, self.ids = index, item, r0, r1, ids
        self.decode = item.parent_ids is None
        self.pos = int(item.state.length)
        # past an image prompt the rows rotate at index + delta (cuda_images.py), as the verbs alone do
        self.shift = rope_shift(item.state, self.pos, 1 if self.decode else max(item.scratch.depths) + 1)


def _at_position(step: Any, vars_: dict[str, Any], j: int) -> Any:
    """A plan call: item j's attention step at its position (and rotary shift) of the replay."""
    return lambda: step(vars_["pos"][j], vars_["shift"][j])


class CudaJointRounds(CudaLayerOps):
    """``joint_forward`` of ``CudaQwen3_5Model`` (see the module docstring).

    ``JOINT_PLANNED`` (default on): passes of decode steps only replay a recorded plan (``_joint_decode_planned``;
    tests/test_cuda_joint.py checks the recording and its replays against each state's own decode steps); off, they
    run the launchers as a verify pass does.
    ``JOINT_BATCHED`` (default on): the decode rows' attention and GDN updates run as one launch a layer for all
    slots (cuda_joint_slots.py; tests/test_cuda_joint_batched.py); off, a launcher call a slot."""

    JOINT_PLANNED = True
    JOINT_BATCHED = True

    def joint_forward(self, items: Sequence[JointItem]) -> list[Any]:
        """Each item's logits (a decode's [V], a verify's [N, V], device float32) or its ValueError, in order;
        items past JOINT_ROWS rows run in further passes. Without the fast kernels (``FAST`` off) each item runs
        alone through its verb."""
        if not self.FAST:
            return run_items_alone(self, items)
        results: list[Any] = [None] * len(items)
        group: list[_Part] = []
        rows = 0
        for k, it in enumerate(items):
            try:
                part = self._place(k, it, rows)
            except ValueError as exc:  # what the verb alone raises; the other items run
                results[k] = exc
                continue
            if group and part.r1 > JOINT_ROWS:
                self._pass(group, results)
                group, rows = [], 0
                part = self._place(k, it, 0)
            group.append(part)
            rows = part.r1
        if group:
            self._pass(group, results)
        return results

    def _place(self, k: int, it: JointItem, r0: int) -> _Part:
        """Check an item as its verb would and give it rows r0..; a verify's tree tables are uploaded (one copy)."""
        if it.parent_ids is None:
            token = it.token_ids[0]
            tid = token.get() if isinstance(token, PendingToken) else int(token)
            check_ids(self.hp, it.state, [tid])
            return _Part(k, it, r0, r0 + 1, [tid])
        scratch = it.scratch
        depths = check_tree(self.hp, it.state, scratch.max_nodes, it.token_ids, it.parent_ids)
        scratch.begin(list(it.parent_ids), depths, it.state.length)
        plan = tree_plan(it.parent_ids)
        table = cupy().asarray(np.asarray([list(it.parent_ids), plan.order, plan.restore, plan.save, depths],
                                          dtype=np.int32))
        scratch.tables = (plan, table[:4], table[4], table[0])
        ids = [int(t) for t in it.token_ids]
        return _Part(k, it, r0, r0 + len(ids), ids)

    def _pass(self, parts: list[_Part], results: list[Any]) -> None:
        """One forward pass over the parts' rows; results, states, scratches and hidden rows written."""
        ids = [t for p in parts for t in p.ids]
        decodes = [p for p in parts if p.decode]
        slots: SlotKernels | None = None

        def mixer(i: int, lw: _Layer, h: Any) -> Any:
            if isinstance(lw.mixer, _Attn):
                return self._joint_attention(i, lw.mixer, h, parts, slots)
            return self._joint_gdn(i, lw.mixer, h, parts, slots)

        if self.JOINT_PLANNED and all(p.decode for p in parts) and self._plannable() and self._fusable():
            normed, logits = self._joint_decode_planned(parts)
        else:
            # decode rows beside verify trees keep their per-slot launches: an engine test of MTP slots on the GPU
            # (tests/test_cuda_joint.py, test_engine_slots_on_the_gpu_give_each_request_its_bits_alone[mtp]) met an
            # illegal address with them batched there
            if self.JOINT_BATCHED and decodes and len(decodes) == len(parts):  # positions, shifts, rows: one copy each
                cache: dict[tuple[int, ...], SlotKernels] = self.__dict__.setdefault("_slot_kernels", {})
                slots = slot_kernels(cache, self.layers, [p.item.state for p in decodes],
                                     self.hp.num_attention_heads, ATTN_FUSED, not self._tc_attention())
                slots.begin([p.pos for p in decodes], [p.shift for p in decodes], [p.r0 for p in decodes])
            with self._launch_checks("joint"):
                normed, logits = self._verify_layers(self._embed(ids), mixer)
        for p in parts:
            it = p.item
            if p.decode:
                it.state.length = p.pos + 1
                if it.hidden_out is not None:
                    it.hidden_out.append(cupy().asnumpy(normed[p.r0:p.r1]))
                results[p.index] = logits[p.r0]
            else:
                it.scratch.set_hidden(normed[p.r0:p.r1])
                results[p.index] = logits[p.r0:p.r1]

    def _joint_decode_planned(self, parts: list[_Part]) -> tuple[Any, Any]:
        """A pass of decode steps through the plan of its states (recorded at the first pass of that set); returns
        (normed [R, E], logits [R, V]): the plan's buffers, overwritten by its next replay. A plan holds its states
        (and their buffers) until it is dropped: MAX_JOINT_PLANS at most, or ``release_joint_plans``."""
        plans: dict[tuple[int, ...], LaunchPlan] = self.__dict__.setdefault("_joint_plans", {})
        states = [p.item.state for p in parts]
        key = tuple(id(s) for s in states)
        ids = np.asarray([p.ids[0] for p in parts], dtype=np.int32)
        plan = plans.pop(key, None)
        if plan is not None and plan.vars["model"] is self and plan.vars["batched"] == self.JOINT_BATCHED \
                and all(a is b for a, b in zip(plan.vars["states"], states)):
            plans[key] = plan  # most recently used last
            plan.vars["ids"], plan.vars["pos"], plan.vars["shift"] = ids, [p.pos for p in parts], [p.shift for p in parts]
            plan.replay()
            normed, logits = plan.outputs
            return normed, logits
        while len(plans) >= MAX_JOINT_PLANS:
            plans.pop(next(iter(plans)))
        cp, hp = cupy(), self.hp
        plan = LaunchPlan()
        plan.vars = {"ids": ids, "pos": [p.pos for p in parts], "shift": [p.shift for p in parts], "model": self,
                     "states": states, "batched": self.JOINT_BATCHED}
        vars_ = plan.vars
        rows = len(parts)
        with persistent():
            ids_device = cp.empty((rows,), dtype=cp.int32)
        shared: list[tuple[Any, Any, Any]] = []  # the attention partials' buffers, shared by every item and layer
        slots: list[SlotKernels] = []  # with JOINT_BATCHED: the plan's own tables (GDN rows 0..R-1, fixed)

        def mixer(i: int, lw: _Layer, h: Any) -> Any:
            w = lw.mixer
            if isinstance(w, _GDN):
                return self._joint_gdn(i, w, h, parts, slots[0] if slots else None)
            qg, k, v = self._qkv(w, h)
            width = hp.num_attention_heads * hp.head_dim
            kind, y = self._joint_out(w.o, rows, width)
            if slots and slots[0].attn is not None:  # every slot's attention: one call of the replay
                plan.add_call(slots[0].attention(i, w, qg, k, v, self.inv_freq, self.eps, kind, y, run=False))
                return self._out_proj(w.o, y)
            if not shared:
                longest = max(states, key=lambda s: int(s.buffers[f"layers.{i}.k"].shape[0]))
                shared.append(decode_scratch(longest.buffers[f"layers.{i}.k"], hp.num_attention_heads))
            for j, p in enumerate(parts):
                kc, vc = p.item.state.buffers[f"layers.{i}.k"], p.item.state.buffers[f"layers.{i}.v"]
                if kind is not None:
                    step = decode_step(qg[j], k[j], v[j], w.q_norm, w.k_norm, self.inv_freq, kc, vc, self.eps,
                                      split=kind, xs=y[j:j + 1], fused=ATTN_FUSED, scratch=shared[0],
                                      tensor_cores=self._tc_attention())
                else:
                    step = decode_step(qg[j], k[j], v[j], w.q_norm, w.k_norm, self.inv_freq, kc, vc, self.eps,
                                      out=y[j], scratch=shared[0], tensor_cores=self._tc_attention())
                plan.add_call(_at_position(step, vars_, j))
            return self._out_proj(w.o, y)

        with plan.record(), self._launch_checks("joint"):
            x = cp.empty((rows, hp.hidden_size), dtype=cp.float32)  # the residual stream, updated in place
            plan.add_call(lambda: ids_device.set(vars_["ids"]))
            if self.JOINT_BATCHED:
                slots.append(SlotKernels(self.layers, states, hp.num_attention_heads, ATTN_FUSED,
                                         not self._tc_attention()))
                plan.add_call(lambda: slots[0].begin(vars_["pos"], vars_["shift"], list(range(rows))))
            embed(self.embed_bits, [0] * rows, out=x, ids_device=ids_device)
            normed, logits = self._verify_layers(x, mixer)
        plan.outputs = (normed, logits)
        plans[key] = plan
        return normed, logits

    def release_joint_plans(self) -> None:
        """Drop the recorded joint decode plans (each holds its states' buffers and its own memory pool) and the
        batched launches' tables of the unplanned passes (each holds its states' buffers)."""
        self.__dict__.pop("_joint_plans", None)
        self.__dict__.pop("_slot_kernels", None)

    def _joint_out(self, lin: Any, rows: int, width: int) -> tuple[str | None, Any]:
        """(split kind, the joint operand buffer of ``lin``: [R, P, width] uint16, or [R, width] float32)."""
        kind = _kind(lin)
        cp = cupy()
        if kind is None:
            return None, cp.empty((rows, width), dtype=np.float32)
        return kind, cp.empty((rows, PARTS[kind], width), dtype=np.uint16)

    def _joint_attention(self, i: int, w: _Attn, h: Any, parts: list[_Part], slots: SlotKernels | None) -> Any:
        """Attention layer i over the parts' rows: the decode rows batched (``slots``, after its ``begin``) or one
        launcher call each, each verify tree its own tree step."""
        hp = self.hp
        qg, k, v = self._qkv(w, h)
        kind, y = self._joint_out(w.o, int(h.shape[0]), hp.num_attention_heads * hp.head_dim)
        batched = slots is not None and slots.attn is not None
        if batched:
            assert slots is not None
            slots.attention(i, w, qg, k, v, self.inv_freq, self.eps, kind, y)
        for p in parts:
            state = p.item.state
            kc, vc = state.buffers[f"layers.{i}.k"], state.buffers[f"layers.{i}.v"]
            r0, r1 = p.r0, p.r1
            if p.decode and batched:
                continue
            if p.decode:
                if kind is not None:
                    attention_decode_step(qg[r0], k[r0], v[r0], w.q_norm, w.k_norm, self.inv_freq, kc, vc, p.pos,
                                          self.eps, split=kind, xs=y[r0:r1], fused=ATTN_FUSED, rope_shift=p.shift,
                                          tensor_cores=self._tc_attention())
                else:
                    attention_decode_step(qg[r0], k[r0], v[r0], w.q_norm, w.k_norm, self.inv_freq, kc, vc, p.pos,
                                          self.eps, out=y[r0], rope_shift=p.shift,
                                          tensor_cores=self._tc_attention())
                continue
            scratch = p.item.scratch
            n = r1 - r0
            _, _, dep_d, par_d = scratch.tables
            kn, vn = scratch.buffers[f"{i}.k"], scratch.buffers[f"{i}.v"]
            if kind is not None:
                attention_tree_step(qg[r0:r1], k[r0:r1], v[r0:r1], w.q_norm, w.k_norm, self.inv_freq, kc, vc,
                                    scratch.start, dep_d, par_d, self.eps, kn[:n], vn[:n], split=kind, xs=y[r0:r1],
                                    rope_shift=p.shift,
                                    tensor_cores=self._tc_attention())
            else:
                attention_tree_step(qg[r0:r1], k[r0:r1], v[r0:r1], w.q_norm, w.k_norm, self.inv_freq, kc, vc,
                                    scratch.start, dep_d, par_d, self.eps, kn[:n], vn[:n], out=y[r0:r1],
                                    rope_shift=p.shift,
                                    tensor_cores=self._tc_attention())
        return self._out_proj(w.o, y)

    def _joint_gdn(self, i: int, w: _GDN, h: Any, parts: list[_Part], slots: SlotKernels | None) -> Any:
        """GDN layer i over the parts' rows: the decode rows batched (``slots``) or one gdn_decode each, each verify
        tree its own gdn_tree."""
        mixed, z, a, b = self._gdn_proj(w, h)
        kind, y = self._joint_out(w.out, int(h.shape[0]), self.hp.value_dim)
        nk = self.hp.linear_num_key_heads
        batched = slots is not None and slots.gdn is not None
        if batched:
            assert slots is not None
            slots.gdn_layer(i, w, mixed, z, a, b, nk, self.eps, kind, y)
        for p in parts:
            state = p.item.state
            tail, ssm = state.buffers[f"layers.{i}.conv"], state.buffers[f"layers.{i}.ssm"]
            r0, r1 = p.r0, p.r1
            if p.decode and batched:
                continue
            if p.decode:
                if kind is not None:
                    gdn_decode(mixed[r0:r1], tail, w.conv, a[r0:r1], b[r0:r1], w.a_log, w.dt_bias, z[r0:r1], w.norm,
                               ssm, nk, self.eps, split=kind, xs=y[r0:r1])
                else:
                    gdn_decode(mixed[r0:r1], tail, w.conv, a[r0:r1], b[r0:r1], w.a_log, w.dt_bias, z[r0:r1], w.norm,
                               ssm, nk, self.eps, out=y[r0:r1])
                continue
            scratch = p.item.scratch
            n = r1 - r0
            pre = scratch.buffers[f"{i}.pre"][:n]  # the pre-conv rows, kept for commit
            pre[...] = mixed[r0:r1]
            plan, table, _, _ = scratch.tables
            if kind is not None:
                gdn_tree(pre, scratch.parent_ids, tail, w.conv, a[r0:r1], b[r0:r1], w.a_log, w.dt_bias, z[r0:r1],
                         w.norm, ssm, nk, self.eps, rows=scratch.gdn_rows(i, n), tables=(plan, table), split=kind,
                         xs=y[r0:r1])
            else:
                gdn_tree(pre, scratch.parent_ids, tail, w.conv, a[r0:r1], b[r0:r1], w.a_log, w.dt_bias, z[r0:r1],
                         w.norm, ssm, nk, self.eps, rows=scratch.gdn_rows(i, n), tables=(plan, table),
                         out=y[r0:r1])
        return self._out_proj(w.out, y)
