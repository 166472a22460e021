"""The CUDA Qwen3.5 model's launch plans (tandem/backend/cuda/plan.py): decode, tree verify and commit recorded once
per state (per scratch and node count, per scratch and path length) and replayed with prebuilt argument blocks;
the calls whose arguments follow the round (the token, the attention position, the committed length) run as calls
of the plan. Same kernels and arguments as the unplanned verbs, so the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda.attention_decode import decode_scratch
from tandem.backend.cuda.attention_switch import decode_step, tree_step
from tandem.backend.cuda.embed import EmbedNormStep, embed
from tandem.backend.cuda.attention_tree import CHUNK, CommitStep, TreePartials
from tandem.backend.cuda.gdn_seq import TreePlan, tree_plan
from tandem.backend.cuda.loader import cupy, persistent
from tandem.backend.cuda.operand import PARTS
from tandem.backend.cuda.plan import LaunchPlan
from tandem.models.device_state import DeviceState
from tandem.models.qwen3_5 import cuda_layer_ops
from tandem.models.qwen3_5.cuda_images import rope_shift
from tandem.models.qwen3_5.cuda_layer_ops import CudaLayerOps
from tandem.models.qwen3_5.cuda_layers import _GDN, _Attn, _Layer, _kind
from tandem.models.qwen3_5.cuda_scratch import CudaTreeScratch


class CudaPlannedVerbs(CudaLayerOps):
    """The planned decode, verify and commit of ``CudaQwen3_5Model`` (see the module docstring)."""

    def _decode_planned(self, state: DeviceState, token: Any, pos: int) -> tuple[Any, Any]:
        """One decode step through the state's LaunchPlan (tandem/backend/cuda/plan.py): the first step runs the
        layer loop normally and records its launches; later steps replay them, the embedding (the token: a host
        id, or a device int32 [1] read by the kernel) and each attention layer (the position) running as calls.
        Same kernels, same arguments, same bits. Past an image prompt the attention calls rotate at pos + the
        sequence's shift (cuda_images.rope_shift; a plan var, so one recorded plan serves every sequence of the state).
        Returns (normed [1, E], logits [V]): the plan's own buffers, overwritten by the next step."""
        plan: LaunchPlan | None = state.decode_plan
        shift = rope_shift(state, pos)
        if plan is not None and plan.vars.get("model") is self:  # a plan replays its own model's weights
            plan.vars["token"], plan.vars["pos"], plan.vars["shift"] = token, pos, shift
            plan.replay()
            normed, logits = plan.outputs
            return normed, logits
        cp, hp = cupy(), self.hp
        plan = LaunchPlan()
        plan.vars = {"token": token, "pos": pos, "shift": shift, "model": self}
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
                h = cp.empty((1, PARTS[kind], hp.hidden_size), dtype=cp.uint16) if kind else cp.empty_like(x)
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
        at ``plan.vars["pos"]`` of each replay (attention_switch.decode_step: attention_decode.DecodeStep, or
        attention_tc.TcDecodeStep with DECODE_ATTENTION on, over the caches kc / vc [max_len, Hkv, D] and the
        partials' buffers ``scratch``; rotated at pos + ``plan.vars["shift"]``, 0 when absent), then the o projection
        (``_out_proj``). Returns its result."""
        cp, hp, vars_ = cupy(), self.hp, plan.vars
        qg, k, v = self._qkv(w, h)
        kind, width = _kind(w.o), hp.num_attention_heads * hp.head_dim
        # a call (the position and the grid follow the step) through prebuilt argument blocks (DecodeStep)
        if kind is not None:  # the combine writes the o projection's split operand
            xs = cp.empty((1, PARTS[kind], width), dtype=cp.uint16)
            step = decode_step(qg[0], k[0], v[0], w.q_norm, w.k_norm, self.inv_freq, kc, vc, self.eps, split=kind,
                              xs=xs, fused=cuda_layer_ops.ATTN_FUSED, scratch=scratch,
                              tensor_cores=self._tc_attention())
            plan.add_call(lambda: step(vars_["pos"], vars_.get("shift", 0)))
            return self._out_proj(w.o, xs)
        y = cp.empty((1, width), dtype=cp.float32)
        step = decode_step(qg[0], k[0], v[0], w.q_norm, w.k_norm, self.inv_freq, kc, vc, self.eps, out=y[0],
                          scratch=scratch, tensor_cores=self._tc_attention())
        plan.add_call(lambda: step(vars_["pos"], vars_.get("shift", 0)))
        return self._out(w.o, y)

    MAX_VERIFY_PLANS = 11  # recorded verify plans kept per state (one per tree size; least recently used dropped)

    def _verify_planned(self, state: DeviceState, scratch: CudaTreeScratch, token_ids: Sequence[int],
                        parent_ids: Sequence[int], depths: list[int]) -> Any:
        """Tree verify through a LaunchPlan per (scratch, node count), as ``_decode_planned``: every round uploads
        one int32 table [6, N] (ids, parents, DFS order, restore, save, depths) and replays; attention layers
        (their chunk count follows the position) run as calls. The GDN scan is recorded with shared memory for
        floor(log2 N) saved state tiles, the most any N-node tree needs (a tree needing more re-records)."""
        cp, hp, n = cupy(), self.hp, len(token_ids)
        shift = rope_shift(state, state.length, max(depths) + 1)  # past an image prompt: index + delta
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
            plan.vars["start"], plan.vars["shift"] = state.length, shift
            plan.replay()
            scratch.hidden_written(n)
            return plan.outputs
        with persistent():
            table = cp.asarray(host)
        slots = max(tp.num_slots, int(np.log2(n)) if n > 1 else 0)
        scratch.tables = (TreePlan(tp.order, tp.restore, tp.save, slots), table[1:5], table[5], table[1])
        plan = LaunchPlan()
        plan.vars = {"table": table, "start": state.length, "shift": shift, "slots": slots, "scratch": scratch,
                     "model": self}
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
                xs = cp.empty((n, PARTS[kind], width), dtype=cp.uint16)
                step = tree_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq, kc, vc, table[5], table[1], self.eps, kn,
                                vn, split=kind, xs=xs, partials=partials, tensor_cores=self._tc_attention())
                plan.add_call(lambda: step(vars_["start"], vars_["shift"]))
                return self._out_proj(w.o, xs)
            if self._resid is not None:  # _fusable() rules it out: the fused loop's o projections read split operands
                raise RuntimeError("_layers_fused: an attention layer without a split o operand")
            y = cp.empty((n, width), dtype=cp.float32)
            step = tree_step(qg, k, v, w.q_norm, w.k_norm, self.inv_freq, kc, vc, table[5], table[1], self.eps, kn, vn,
                            out=y, partials=partials, tensor_cores=self._tc_attention())
            plan.add_call(lambda: step(vars_["start"], vars_["shift"]))
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

    MAX_COMMIT_PLANS = 64  # recorded commits kept per state (one per scratch and path length; least recent dropped)

    def _commit_planned(self, state: DeviceState, scratch: CudaTreeScratch, path: Sequence[int]) -> None:
        """The commit through a LaunchPlan per (scratch, path length), as ``_verify_planned``: each call uploads the
        path (int32 [L]) into the plan's buffer and replays: a GDN layer's replay of the path onto its entry state
        (gdn_commit: its rows are views of the scratch's fixed buffers whatever the tree's size), an attention
        layer's row copies as a call (attention_tree.CommitStep: the start follows the state). Same kernels and
        arguments as the unplanned commit, so the same bits (the unplanned commit's host time is many times its
        kernels': bench/host_replay.py)."""
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
