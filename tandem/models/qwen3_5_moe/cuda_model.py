"""The Qwen3.5-MoE / Qwen3-Next text model on the CUDA backend: the dense CUDA model with sparse feed-forwards.

``CudaQwen3_5MoeModel`` is ``CudaQwen3_5Model`` (tandem/models/qwen3_5/cuda_model.py: GDN and attention layers, the
state, prefill / decode / verify / commit, launch plans, the device sampler and MTP head) with one declared
difference per sparse layer: its ``gate_up`` is a ``CudaMoE`` (tandem/backend/cuda/moe.py: router, top-k and the
chosen experts' GEMVs on the device, the shared expert (stacked with the routed ones where its shapes are theirs),
the weighted sum) and its ``down`` a ``MoEDelta`` (the
residual add and the next norm: add_rms_norm), so the dense layer loop, fused or not, runs it unchanged. Dense
layers (Qwen3-Next ``mlp_only_layers``) are the dense model's. Qwen3-Next's fused GDN projections (``RowSelect``)
are uploaded as the four Qwen3.5 projections (rows of the fused weight).

Row invariance holds as in the dense model (moe.py), so verify rows equal decode rows and speculation stays exact.
Declared for the speculator: ``Capabilities.expert_routing`` = (experts, top-k, the routed experts' share of a
decode step's weight bytes): a verify reads each distinct expert its rows chose once, and StairCut prices the tree
by the expected number of distinct experts (tandem/speculative/staircut.py ``PriceCurve.with_routing``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.loader import cupy
from tandem.backend.cuda.moe import GEMVS, CudaMoE, MoEDelta, upload_experts
from tandem.backend.cuda.upload import to_device_linear
from tandem.checkpoint import Checkpoint
from tandem.formats import DenseLinear
from tandem.models.protocol import Capabilities
from tandem.models.qwen3_5.cuda_layers import _GDN, _Layer, _fuse
from tandem.models.qwen3_5.cuda_model import CudaQwen3_5Model
from tandem.models.qwen3_5.weights import LayerWeights
from tandem.models.qwen3_5_moe.moe import SparseMoE
from tandem.models.qwen3_5_moe.weights import MoELayerWeights
from tandem.models.qwen3_next.gdn import RowSelect


# A shared expert of the routed experts' format and shapes (the releases': I_s = I_e = 512) is stacked as expert X
# (moe.CudaMoE ``stacked``): its rows run in the routed experts' two launches instead of three of its own.
STACK_SHARED = True


def upload_rows(lin: Any, ckpt: Checkpoint | None) -> Any:
    """A host Linear on the device; a ``RowSelect`` (Qwen3-Next's fused GDN projections) as a device Linear of its
    rows: BF16 bits of the selected rows where the inner weight is exactly BF16, else the fp32 rows (CudaF32Linear
    through to_device_linear)."""
    if not isinstance(lin, RowSelect):
        return to_device_linear(lin, ckpt)
    inner = lin.inner
    if not isinstance(inner, DenseLinear):
        raise ValueError(f"{lin.name}: no device upload for {type(inner).__name__}")
    return to_device_linear(DenseLinear(np.ascontiguousarray(inner.weight[lin.rows]), lin.name), None)


class CudaQwen3_5MoeModel(CudaQwen3_5Model):
    """Qwen3.5-MoE / Qwen3-Next on one GPU (see the module docstring). Args: host: the loaded host MoE model.
    Raises: ValueError for experts the CUDA MoE GEMVs cannot take (moe.upload_experts: one line naming the tensor)."""

    JOINT = False  # the slots interleave its calls; a joint pass over routed experts is not built

    @staticmethod
    def _upload(lin: Any, ckpt: Checkpoint | None) -> Any:
        return upload_rows(lin, ckpt)

    def _layer(self, lw: LayerWeights, ckpt: Checkpoint | None) -> _Layer:
        layer = super()._layer(lw, ckpt)
        if not isinstance(lw, MoELayerWeights) or not isinstance(lw.ffn, SparseMoE):
            return layer
        moe, hp = lw.ffn, self.hp
        name = str(getattr(moe.router, "name", "mlp.gate")).removesuffix(".gate")
        router, shared_gate = self._upload(moe.router, ckpt), self._upload(moe.shared_gate, ckpt)
        fused = _fuse([router, shared_gate])
        gates, ups, downs = ([self._upload(getattr(x, part), ckpt) for x in moe.experts]
                             for part in ("gate", "up", "down"))
        shared = [self._upload(lin, ckpt) for lin in (lw.mlp.gate, lw.mlp.up, lw.mlp.down)]
        stacked = STACK_SHARED and all(type(a) is type(b[0]) and a.shape == b[0].shape
                                       for a, b in zip(shared, (gates, ups, downs)))
        if stacked:  # the shared expert as expert X of the routed experts' launches
            gates, ups, downs = gates + shared[:1], ups + shared[1:2], downs + shared[2:]
        gate_up, down = upload_experts(gates, ups, downs, name + ".experts")
        keep = not stacked  # the shared expert's own Linears (base _layer's upload), when not stacked
        layer.gate_up = CudaMoE(fused if fused is not None else router, None if fused is not None else shared_gate,
                                moe_experts(moe), moe.top_k, moe.norm_topk_prob, gate_up, down,
                                layer.gate_up if keep else None, layer.gate if keep else None,
                                layer.up if keep else None, layer.down if keep else None, stacked=stacked)
        del gates, ups, downs, shared
        layer.gate = layer.up = None
        layer.down = MoEDelta(hp.hidden_size)
        cupy().get_default_memory_pool().free_all_blocks()  # the stacked copies replaced the per-expert uploads
        return layer

    def _capabilities(self) -> Capabilities:
        """The dense model's capabilities plus ``expert_routing`` (experts, top-k, routed share of a step's bytes)."""
        base = super()._capabilities()
        return Capabilities(**{**base.__dict__, "expert_routing": self.expert_routing()})

    def expert_routing(self) -> tuple[int, int, float] | None:
        """(experts X, top-k, the share of one decode step's weight bytes the k routed experts make: the part a
        verify multiplies by distinct experts / k), or None for a model without sparse layers."""
        moes = [lw.gate_up for lw in self.layers if isinstance(lw.gate_up, CudaMoE)]
        if not moes:
            return None
        routed = sum(m.top_k * m.expert_bytes for m in moes)
        total = int(self.head.bytes_per_use)  # a decode step's weight bytes: a MoE layer's k experts, not all
        for lw in self.layers:
            ffn = lw.gate_up
            lins = _layer_linears(lw)[:-len(ffn.linears())] + [ffn] if isinstance(ffn, CudaMoE) else _layer_linears(lw)
            total += sum(int(lin.bytes_per_use) for lin in lins if lin is not None)
        return (moes[0].experts, moes[0].top_k, round(routed / max(total, 1), 4))

    def _plannable(self) -> bool:
        """The dense condition (BF16 embedding, every Linear a gemv.py GEMV), a MoE layer's Linears included."""
        cached = self._plannable_cache
        if cached is None:
            lins = [self.head] + [lin for lw in self.layers for lin in _layer_linears(lw)]
            cached = self.embed_bits is not None and all(lin is None or isinstance(lin, GEMVS) for lin in lins)
            self._plannable_cache = cached
        return cached

    def _fusable(self) -> bool:
        """The dense condition on every mixer and dense MLP (a MoE layer's feed-forward reads fp32 rows and adds its
        residual through MoEDelta, which takes any row count)."""
        cached = self._fusable_cache
        if cached is None:
            def v2(lin: Any) -> bool:
                return isinstance(lin, GEMVS) and lin.prep_kind is not None

            def layer_ok(lw: _Layer) -> bool:
                m = lw.mixer
                out = m.out if isinstance(m, _GDN) else m.o
                mlp = [] if isinstance(lw.gate_up, CudaMoE) else [lw.gate_up, lw.down]
                return all(v2(lin) for lin in [m.proj, out] + mlp)

            cached = self.embed_bits is not None and v2(self.head) and all(layer_ok(lw) for lw in self.layers)
            self._fusable_cache = cached
        return cached


def moe_experts(moe: SparseMoE) -> int:
    """The layer's routed expert count."""
    return len(moe.experts)


def _layer_linears(lw: _Layer) -> list[Any]:
    """A device layer's Linears (a MoE layer's: its router, experts and shared expert)."""
    m = lw.mixer
    parts = [m.proj, m.in_qkv, m.in_z, m.in_a, m.in_b, m.out] if isinstance(m, _GDN) else [m.proj, m.q, m.k, m.v, m.o]
    if isinstance(lw.gate_up, CudaMoE):
        return parts + lw.gate_up.linears()
    return parts + [lw.gate_up, lw.gate, lw.up, lw.down]
