"""Qwen3.5 text weights: tensor names and shapes (spec/qwen3_5.md §2), loaded into fp32 and Linear objects.

Norm weights of the zero-centred RMSNorms are stored as (1 + w) in fp32 at load, the GDN gated-norm weight as
is (§3.1, §3.2). ``A_log`` and ``dt_bias`` are read in their stored dtype and widened exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.formats import Linear, load_linear
from tandem.models.qwen3_5.hparams import FULL, HParams

F32 = np.float32


@dataclass
class MLPWeights:
    """Dense SiLU MLP: gate/up [F, E], down [E, F]."""

    gate: Linear
    up: Linear
    down: Linear


@dataclass
class GDNWeights:
    """Gated DeltaNet layer. in_qkv [conv_dim, E], in_z [Hv·dv, E], in_b/in_a [Hv, E], out [E, Hv·dv];
    conv [conv_dim, K]; a_log, dt_bias [Hv]; norm [dv] (gated RMSNorm weight, used as is)."""

    in_qkv: Linear
    in_z: Linear
    in_b: Linear
    in_a: Linear
    out: Linear
    conv: np.ndarray
    a_log: np.ndarray
    dt_bias: np.ndarray
    norm: np.ndarray


@dataclass
class AttnWeights:
    """Gated full attention. q [2·H·D, E] (per head: D query rows then D gate rows), k/v [Hkv·D, E],
    o [E, H·D]; q_norm/k_norm [D] as (1 + w)."""

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: np.ndarray
    k_norm: np.ndarray


@dataclass
class LayerWeights:
    """One decoder layer: input/post norms [E] as (1 + w), the mixer (GDN or attention) and the MLP."""

    kind: str
    input_norm: np.ndarray
    post_norm: np.ndarray
    mixer: GDNWeights | AttnWeights
    mlp: MLPWeights


@dataclass
class ModelWeights:
    """All text weights: embed [V, E] float32, layers, final norm [E] as (1 + w), head (tied or not)."""

    embed: np.ndarray
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: Linear | None  # None when tied: logits = x · embedᵀ


def text_prefix(ckpt: Checkpoint) -> str:
    """``model.language_model.`` for the VLM release layout, ``model.`` for flat text checkpoints."""
    return "model.language_model." if ckpt.has("model.language_model.embed_tokens.weight") else "model."


def norm1p(ckpt: Checkpoint, name: str, size: int) -> np.ndarray:
    """A zero-centred RMSNorm weight [size] as (1 + w) float32 (spec §3.1). Raises CheckpointError (missing or
    mis-shaped)."""
    return (ckpt.get(name, (size,)) + F32(1.0)).astype(F32)


def load_mlp(ckpt: Checkpoint, p: str, hp: HParams) -> MLPWeights:
    """Load ``{p}mlp.{gate,up,down}_proj``."""
    mlp = MLPWeights(load_linear(ckpt, p + "mlp.gate_proj"), load_linear(ckpt, p + "mlp.up_proj"),
                     load_linear(ckpt, p + "mlp.down_proj"))
    check_shape(mlp.gate, (hp.intermediate_size, hp.hidden_size), p + "mlp.gate_proj")
    check_shape(mlp.up, (hp.intermediate_size, hp.hidden_size), p + "mlp.up_proj")
    check_shape(mlp.down, (hp.hidden_size, hp.intermediate_size), p + "mlp.down_proj")
    return mlp


def load_attention(ckpt: Checkpoint, p: str, hp: HParams) -> AttnWeights:
    """Load ``{p}self_attn.*``."""
    e, d, h, hkv = hp.hidden_size, hp.head_dim, hp.num_attention_heads, hp.num_key_value_heads
    w = AttnWeights(
        load_linear(ckpt, p + "self_attn.q_proj"), load_linear(ckpt, p + "self_attn.k_proj"),
        load_linear(ckpt, p + "self_attn.v_proj"), load_linear(ckpt, p + "self_attn.o_proj"),
        norm1p(ckpt, p + "self_attn.q_norm.weight", d), norm1p(ckpt, p + "self_attn.k_norm.weight", d))
    check_shape(w.q, (2 * h * d, e), p + "self_attn.q_proj")
    check_shape(w.k, (hkv * d, e), p + "self_attn.k_proj")
    check_shape(w.v, (hkv * d, e), p + "self_attn.v_proj")
    check_shape(w.o, (e, h * d), p + "self_attn.o_proj")
    return w


def load_gdn(ckpt: Checkpoint, p: str, hp: HParams) -> GDNWeights:
    """Load ``{p}linear_attn.*``."""
    q = p + "linear_attn."
    e, hv = hp.hidden_size, hp.linear_num_value_heads
    w = GDNWeights(
        load_linear(ckpt, q + "in_proj_qkv"), load_linear(ckpt, q + "in_proj_z"),
        load_linear(ckpt, q + "in_proj_b"), load_linear(ckpt, q + "in_proj_a"),
        load_linear(ckpt, q + "out_proj"),
        np.ascontiguousarray(ckpt.get(q + "conv1d.weight", (hp.conv_dim, 1, hp.linear_conv_kernel_dim))[:, 0, :]),
        ckpt.get(q + "A_log", (hv,)), ckpt.get(q + "dt_bias", (hv,)),
        ckpt.get(q + "norm.weight", (hp.linear_value_head_dim,)))
    check_shape(w.in_qkv, (hp.conv_dim, e), q + "in_proj_qkv")
    check_shape(w.in_z, (hp.value_dim, e), q + "in_proj_z")
    check_shape(w.in_b, (hv, e), q + "in_proj_b")
    check_shape(w.in_a, (hv, e), q + "in_proj_a")
    check_shape(w.out, (e, hp.value_dim), q + "out_proj")
    return w


def load_weights(ckpt: Checkpoint, hp: HParams, progress: Callable[[int], None] | None = None) -> ModelWeights:
    """Load every text weight (vision tower and ``mtp.*`` are never read).

    Args:
        progress: called with 1 after each layer (for a progress bar).
    Raises:
        CheckpointError: a tensor is missing, mis-shaped, truncated or of an unknown dtype.
    """
    pre = text_prefix(ckpt)
    e = hp.hidden_size
    layers = []
    for i, kind in enumerate(hp.layer_types):
        p = f"{pre}layers.{i}."
        mixer: GDNWeights | AttnWeights = load_attention(ckpt, p, hp) if kind == FULL else load_gdn(ckpt, p, hp)
        layers.append(LayerWeights(kind, norm1p(ckpt, p + "input_layernorm.weight", e),
                                   norm1p(ckpt, p + "post_attention_layernorm.weight", e), mixer,
                                   load_mlp(ckpt, p, hp)))
        if progress is not None:
            progress(1)
    return with_embed_and_head(ckpt, pre, hp, layers)


def with_embed_and_head(ckpt: Checkpoint, pre: str, hp: HParams, layers: list[LayerWeights]) -> ModelWeights:
    """``layers`` with the embedding [V, E], the final norm and the lm_head (None when tied and absent).
    Raises: CheckpointError for a missing or mis-shaped tensor."""
    e = hp.hidden_size
    embed = ckpt.get(pre + "embed_tokens.weight", (hp.vocab_size, e))
    head = None
    if not hp.tie_word_embeddings or ckpt.has("lm_head.weight"):
        head = load_linear(ckpt, "lm_head")
        check_shape(head, (hp.vocab_size, e), "lm_head")
    return ModelWeights(embed, layers, norm1p(ckpt, pre + "norm.weight", e), head)


def check_shape(lin: Linear, shape: tuple[int, int], name: str) -> None:
    """Raises CheckpointError naming ``name`` when ``lin`` is not of ``shape`` [out, in]."""
    if tuple(lin.shape) != shape:
        raise CheckpointError(f"{name}: expected shape {list(shape)}, found {list(lin.shape)}")
