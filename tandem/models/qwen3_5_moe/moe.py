"""The sparse MoE MLP on the NumPy reference backend: router, routed SwiGLU experts, gated shared expert.

Implements spec/qwen3_5.md §7 (transformers' ``Qwen3NextSparseMoeBlock``, which Qwen3.5-MoE reuses) in float32:
1. router logits ℓ = x · W_gateᵀ [T, E]; p = softmax(ℓ) over all E experts;
2. the k most probable experts per row, equal probabilities to the lower expert index (a stable sort of −p,
   so the choice is deterministic and the same for 1 or N rows); their weights p, renormalised to sum to 1
   when ``norm_topk_prob``;
3. each chosen expert e: y_e = down_e( silu(gate_e x) ⊙ up_e x ), accumulated as Σ w_e · y_e in ascending
   expert index (transformers' ``index_add_`` order);
4. plus the shared expert σ(x · w_sgᵀ) · SwiGLU_shared(x).
Row invariance: every projection goes through the given matmul (``Linear.matmul`` on the decode and verify
paths, one GEMV per row); softmax, top-k and the sums act on each row alone, so a row's bits do not depend on
how many rows are processed together nor on which other rows chose the same experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.backend import numpy_ops as ops
from tandem.formats import Linear
from tandem.models.qwen3_5.weights import MLPWeights

F32 = np.float32
MatMul = Callable[[Linear, np.ndarray], np.ndarray]


def swiglu(w: MLPWeights, h: np.ndarray, mm: MatMul) -> np.ndarray:
    """down( silu(gate h) ⊙ up h ): h [T, E] float32 -> [T, E] float32 (the dense MLP's arithmetic)."""
    return mm(w.down, ops.silu(mm(w.gate, h)) * mm(w.up, h))


def route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k routing of router logits [T, E] float32.

    Returns: (experts [T, k] int64, most probable first, ties to the lower index; weights [T, k] float32, the
    softmax probabilities of those experts, divided by their sum when ``renormalize``).
    """
    lg = logits.astype(F32, copy=False)
    e = np.exp(lg - lg.max(axis=-1, keepdims=True))
    p = (e / e.sum(axis=-1, keepdims=True)).astype(F32)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, axis=-1)
    if renormalize:
        w = (w / w.sum(axis=-1, keepdims=True)).astype(F32)
    return top.astype(np.int64), w


@dataclass
class DenseFFN:
    """A dense SwiGLU MLP as a layer's feed-forward (Qwen3-Next ``mlp_only_layers``)."""

    mlp: MLPWeights

    def __call__(self, h: np.ndarray, mm: MatMul) -> np.ndarray:
        """h [T, E] float32 -> [T, E] float32."""
        return swiglu(self.mlp, h, mm)


@dataclass
class SparseMoE:
    """A sparse MoE MLP. router [E_x, E] (E_x experts); experts[e]: gate/up [I, E], down [E, I];
    shared: the shared expert (width I_s); shared_gate [1, E]; top_k ≤ E_x; norm_topk_prob."""

    router: Linear
    experts: list[MLPWeights]
    shared: MLPWeights
    shared_gate: Linear
    top_k: int
    norm_topk_prob: bool

    def __call__(self, h: np.ndarray, mm: MatMul) -> np.ndarray:
        """h [T, E] float32 -> [T, E] float32 (spec §7)."""
        top, w = route(mm(self.router, h), self.top_k, self.norm_topk_prob)
        out = np.zeros(h.shape, F32)
        for e in np.unique(top):  # ascending expert index
            rows, slot = np.nonzero(top == e)
            y = swiglu(self.experts[int(e)], np.ascontiguousarray(h[rows]), mm)
            out[rows] += y * w[rows, slot][:, None]
        out += ops.sigmoid(mm(self.shared_gate, h)) * swiglu(self.shared, h, mm)
        return out

    def experts_used(self, h: np.ndarray, mm: MatMul) -> np.ndarray:
        """The sorted distinct experts the rows of h [T, E] choose (int64), e.g. to count expert bytes read."""
        top, _ = route(mm(self.router, h), self.top_k, self.norm_topk_prob)
        used: np.ndarray = np.unique(top)
        return used


FFN = DenseFFN | SparseMoE
