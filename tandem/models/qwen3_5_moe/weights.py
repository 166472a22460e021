"""Qwen3.5-MoE / Qwen3-Next text weights: the dense model's mixers and norms, and the sparse MLPs.

Tensor names (spec/qwen3_5.md §2.3; prefix ``{layer}.mlp.``): ``gate.weight`` router [E_x, E];
``shared_expert.{gate,up,down}_proj``, ``shared_expert_gate.weight`` [1, E]; routed experts either per expert
(``experts.{e}.{gate,up,down}_proj`` in any format ``load_linear`` reads: BF16, FP8 block, NVFP4; as FP8/NVFP4
releases and transformers' ``save_pretrained`` write them) or fused 3-D (``experts.gate_up_proj`` [E_x, 2I, E],
rows [0, I) gate and [I, 2I) up, and ``experts.down_proj`` [E_x, E, I]; no ``.weight`` suffix; BF16/F16/F32,
as the BF16 releases ship them). The attention and GDN layers load through tandem/models/qwen3_5/weights.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.dtypes import bf16_to_f32, f16_to_f32
from tandem.formats import DenseLinear, load_linear
from tandem.models.qwen3_5.hparams import FULL
from tandem.models.qwen3_5.weights import (AttnWeights, GDNWeights, LayerWeights, MLPWeights, ModelWeights,
                                           check_shape, load_attention, norm1p, text_prefix, with_embed_and_head)
from tandem.models.qwen3_5_moe.hparams import MoEHParams
from tandem.models.qwen3_5_moe.moe import FFN, DenseFFN, SparseMoE

F32 = np.float32
GDNLoader = Callable[[Checkpoint, str, MoEHParams], GDNWeights]


@dataclass
class MoELayerWeights(LayerWeights):
    """A decoder layer whose feed-forward is ``ffn`` (the sparse MoE or a dense MLP); ``mlp`` is the dense MLP
    of a dense layer and the shared expert of a sparse one (the MLP every token runs)."""

    ffn: FFN


def _swiglu(ckpt: Checkpoint, p: str, e: int, width: int) -> MLPWeights:
    """``{p}{gate,up,down}_proj`` with gate/up [width, e], down [e, width]."""
    w = MLPWeights(load_linear(ckpt, p + "gate_proj"), load_linear(ckpt, p + "up_proj"),
                   load_linear(ckpt, p + "down_proj"))
    check_shape(w.gate, (width, e), p + "gate_proj")
    check_shape(w.up, (width, e), p + "up_proj")
    check_shape(w.down, (e, width), p + "down_proj")
    return w


def _decoded(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> Callable[[int], np.ndarray]:
    """Expert slice reader of a fused 3-D tensor: index -> float32 [shape[1], shape[2]] (decoded on demand)."""
    if ckpt.shape(name) != shape:
        raise CheckpointError(f"{name}: expected shape {list(shape)}, found {list(ckpt.shape(name))}")
    dtype, bits = ckpt.dtype(name), ckpt.raw(name)
    if dtype == "BF16":
        return lambda i: bf16_to_f32(np.asarray(bits[i], dtype=np.uint16))
    if dtype == "F16":
        return lambda i: f16_to_f32(np.asarray(bits[i], dtype=np.uint16))
    if dtype == "F32":
        return lambda i: np.array(bits[i], dtype=F32)
    raise CheckpointError(f"{name}: fused experts must be BF16, F16 or F32, found {dtype} (quantised experts are "
                          "stored per expert)")


def load_experts(ckpt: Checkpoint, p: str, hp: MoEHParams) -> list[MLPWeights]:
    """The routed experts under ``{p}experts.`` in the fused or the per-expert layout.

    Raises: CheckpointError: an expert missing or mis-shaped, a fused tensor of another dtype, or an expert
    beyond ``num_experts`` stored (a checkpoint of another expert count).
    """
    n, e, i = hp.num_experts, hp.hidden_size, hp.moe_intermediate_size
    q = p + "experts."
    if ckpt.has(q + "gate_up_proj") or ckpt.has(q + "down_proj"):
        gate_up = _decoded(ckpt, q + "gate_up_proj", (n, 2 * i, e))
        down = _decoded(ckpt, q + "down_proj", (n, e, i))
        out = []
        for x in range(n):
            gu = gate_up(x)
            out.append(MLPWeights(DenseLinear(np.ascontiguousarray(gu[:i]), f"{q}{x}.gate_proj"),
                                  DenseLinear(np.ascontiguousarray(gu[i:]), f"{q}{x}.up_proj"),
                                  DenseLinear(down(x), f"{q}{x}.down_proj")))
        return out
    extra = f"{q}{n}.gate_proj"
    if any(ckpt.has(f"{extra}.{s}") for s in ("weight", "weight_packed")):
        raise CheckpointError(f"{extra}: the checkpoint stores more experts than num_experts ({n})")
    return [_swiglu(ckpt, f"{q}{x}.", e, i) for x in range(n)]


def load_ffn(ckpt: Checkpoint, p: str, hp: MoEHParams, sparse: bool) -> tuple[MLPWeights, FFN]:
    """The feed-forward under ``{p}mlp.``: (the MLP every token runs, the layer's FFN). Raises CheckpointError."""
    m, e = p + "mlp.", hp.hidden_size
    if not sparse:
        dense = _swiglu(ckpt, m, e, hp.intermediate_size)
        return dense, DenseFFN(dense)
    experts = load_experts(ckpt, m, hp)  # first: an expert-count mismatch is named as such
    router = load_linear(ckpt, m + "gate")
    check_shape(router, (hp.num_experts, e), m + "gate")
    shared = _swiglu(ckpt, m + "shared_expert.", e, hp.shared_expert_intermediate_size)
    shared_gate = load_linear(ckpt, m + "shared_expert_gate")
    check_shape(shared_gate, (1, e), m + "shared_expert_gate")
    return shared, SparseMoE(router, experts, shared, shared_gate, hp.num_experts_per_tok, hp.norm_topk_prob)


def load_moe_weights(ckpt: Checkpoint, hp: MoEHParams, load_gdn: GDNLoader,
                     progress: Callable[[int], None] | None = None) -> ModelWeights:
    """Every text weight (``model.visual.*`` and ``mtp.*`` are never read); layers are ``MoELayerWeights``.

    Args: load_gdn: the adapter's GDN loader (split or fused projections). progress: called with 1 per layer.
    Raises: CheckpointError: a tensor is missing, mis-shaped, truncated or of an unknown dtype.
    """
    pre, e = text_prefix(ckpt), hp.hidden_size
    layers: list[LayerWeights] = []
    for i, kind in enumerate(hp.layer_types):
        p = f"{pre}layers.{i}."
        mixer: GDNWeights | AttnWeights = load_attention(ckpt, p, hp) if kind == FULL else load_gdn(ckpt, p, hp)
        mlp, ffn = load_ffn(ckpt, p, hp, hp.sparse_layers[i])
        layers.append(MoELayerWeights(kind, norm1p(ckpt, p + "input_layernorm.weight", e),
                                      norm1p(ckpt, p + "post_attention_layernorm.weight", e), mixer, mlp, ffn))
        if progress is not None:
            progress(1)
    return with_embed_and_head(ckpt, pre, hp, layers)
