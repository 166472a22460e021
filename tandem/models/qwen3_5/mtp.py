"""The Qwen3.5 MTP (multi-token prediction) head, the checkpoint's built-in drafter (spec/qwen3_5.md §2.4, §8).

One draft step for a token x at position t with a hidden state h (the target's post-final-norm hidden state of
position t, or the head's own output hidden state of the previous step):
    u = fc( concat[ pre_fc_norm_embedding(embed[x]), pre_fc_norm_hidden(h) ] )   (embedding FIRST; fc: 2E → E)
    u = u + attention(input_layernorm(u)) at position t   (its own KV cache; q/k norms, partial RoPE, gate)
    u = u + mlp(post_attention_layernorm(u))
    y = mtp.norm(u);  logits = lm_head(y)   (the target's head), and y is the next step's h.
Row t consumes (token_{t+1}, h_t) and predicts token_{t+2}. The drafter is tandem/speculative/mtp_drafter.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.backend import numpy_ops as ops
from tandem.backend.kv_rows import read_rows, write_rows
from tandem.checkpoint import Checkpoint
from tandem.formats import Linear, load_linear
from tandem.models.qwen3_5.host import HostModel
from tandem.models.qwen3_5.weights import AttnWeights, LayerWeights, check_shape, load_attention, load_mlp, norm1p
from tandem.models.state import BufferSpec, ModelState

F32 = np.float32


def _mm(lin: Linear, x: np.ndarray) -> np.ndarray:
    return lin.matmul(x)


@dataclass
class MTPWeights:
    """norm_embedding/norm_hidden/norm [E] as (1 + w); fc [E, 2E]; layer: one full-attention decoder layer."""

    norm_embedding: np.ndarray
    norm_hidden: np.ndarray
    fc: Linear
    layer: LayerWeights
    norm: np.ndarray


class MTPHead:
    """The MTP head bound to its target model (shared embedding and lm_head).

    Args: model: the target model (a ``Qwen3_5Model``, as ``host.HostModel``). weights: the ``mtp.*`` tensors.
    """

    max_top_k: int | None = None  # ``top_probs`` takes any k
    chains = False  # no ``chain``: the drafter runs its rows one by one

    def __init__(self, model: HostModel, weights: MTPWeights) -> None:
        self.model = model
        self.weights = weights

    def new_state(self, max_len: int) -> ModelState:
        """The head's own KV cache: ``k``/``v`` [max_len, Hkv, D] views in the target's ``kv_dtype``."""
        hp, kv = self.model.hp, self.model.kv_dtype
        shape = (max_len, hp.num_key_value_heads, hp.head_dim)
        return ModelState([BufferSpec("k", shape, kv, "view"), BufferSpec("v", shape, kv, "view")], max_len)

    def forward(self, state: ModelState, token_ids: list[int], hidden: np.ndarray, start: int) -> np.ndarray:
        """Rows at positions start..start+T-1 (causal among themselves, after cache rows 0..start-1).

        Args: token_ids: [T] (token_{t+1} for row t); hidden: [T, E] float32 (h_t).
        Returns: the head's output hidden states [T, E] float32 (post ``mtp.norm``). Writes cache rows; sets
        state.length to start + T.
        Raises: ValueError when the rows do not fit the state.
        """
        t = len(token_ids)
        if start + t > state.max_len:
            raise ValueError(f"MTP rows {start}..{start + t - 1} exceed its cache of {state.max_len}")
        hp, w, eps = self.model.hp, self.weights, self.model.hp.rms_norm_eps
        e = self.model.weights.embed[np.asarray(token_ids, dtype=np.int64)].astype(F32)
        both = np.concatenate([ops.rms_norm(e, w.norm_embedding, eps),
                               ops.rms_norm(hidden.astype(F32), w.norm_hidden, eps)], axis=1)
        u = _mm(w.fc, both)
        lw = w.layer
        assert isinstance(lw.mixer, AttnWeights)
        h = ops.rms_norm(u, lw.input_norm, eps)
        q, k, v, gate = self.model.attention_qkv(lw.mixer, h, np.arange(start, start + t), _mm)
        kc, vc = state.buffers["k"], state.buffers["v"]
        write_rows(kc, start, k)
        write_rows(vc, start, v)
        keys, values = read_rows(kc, start + t), read_rows(vc, start + t)
        a = ops.attention_rows(q, keys, values, np.arange(start, start + t))  # row-invariant: the same bits for any T
        u = u + self.model.attention_output(lw.mixer, a, gate, _mm)
        u = u + self.model._mlp(lw, ops.rms_norm(u, lw.post_norm, eps), _mm)
        state.length = start + t
        return ops.rms_norm(u, w.norm, hp.rms_norm_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The target's lm_head over the head's output hidden states: [T, E] -> [T, V] float32."""
        return _mm(self.model.head, hidden)

    def top_probs(self, hidden: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best k next ids after the last row of ``hidden`` [T, E] and their softmax probabilities over the
        vocabulary: (ids [k] int64, the most probable first, equal probabilities to the smaller id; probs [k]
        float64). Raises: ValueError for k < 1."""
        if k < 1:
            raise ValueError(f"k must be ≥ 1, got {k}")
        logits = self.logits(hidden[-1:])[0].astype(np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[:k]
        return top.astype(np.int64), probs[top]


def load_mtp(model: HostModel, load_layer: Callable[[Checkpoint, str], LayerWeights] | None = None
             ) -> MTPHead | None:
    """Load ``mtp.*`` from the model's checkpoint directory; None when the checkpoint has no MTP layer.

    ``load_layer(ckpt, prefix)`` builds the head's decoder layer from ``mtp.layers.0.``; the default is the dense
    layer (norms, attention, SwiGLU MLP); an adapter whose MTP layer differs (a MoE feed-forward) passes its own.
    Raises: CheckpointError for a present but malformed MTP layer.
    """
    if model.path is None:
        return None
    ckpt = Checkpoint.open(model.path)
    if not ckpt.has("mtp.fc.weight"):
        return None
    hp, e = model.hp, model.hp.hidden_size

    def dense_layer(ckpt: Checkpoint, p: str) -> LayerWeights:
        return LayerWeights("full_attention", norm1p(ckpt, p + "input_layernorm.weight", e),
                            norm1p(ckpt, p + "post_attention_layernorm.weight", e), load_attention(ckpt, p, hp),
                            load_mlp(ckpt, p, hp))

    layer = (load_layer or dense_layer)(ckpt, "mtp.layers.0.")
    fc = load_linear(ckpt, "mtp.fc")
    check_shape(fc, (e, 2 * e), "mtp.fc")
    return MTPHead(model, MTPWeights(norm1p(ckpt, "mtp.pre_fc_norm_embedding.weight", e),
                                     norm1p(ckpt, "mtp.pre_fc_norm_hidden.weight", e), fc, layer,
                                     norm1p(ckpt, "mtp.norm.weight", e)))
