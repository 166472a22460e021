"""The MTP head of the MoE members (spec/qwen3_5.md §2.4, §8): the dense ``MTPHead`` with a MoE layer.

``mtp.layers.0`` is one full-attention decoder layer whose MLP is the model type's: a sparse MoE
(``mtp.layers.0.mlp.gate.weight`` present; experts fused or per expert as the main layers) or a dense MLP.
``MTPHead.forward`` runs it through the adapter's ``_mlp``.
"""

from __future__ import annotations

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.formats import load_linear
from tandem.models.qwen3_5.host import HostModel
from tandem.models.qwen3_5.mtp import MTPHead, MTPWeights
from tandem.models.qwen3_5.weights import load_attention, norm1p
from tandem.models.qwen3_5_moe.hparams import MoEHParams
from tandem.models.qwen3_5_moe.weights import MoELayerWeights, load_ffn


def load_moe_mtp(model: HostModel) -> MTPHead | None:
    """Load ``mtp.*`` from the model's checkpoint directory; None when the checkpoint has no MTP layer.

    Raises: CheckpointError for a present but malformed MTP layer.
    """
    if model.path is None:
        return None
    ckpt = Checkpoint.open(model.path)
    if not ckpt.has("mtp.fc.weight"):
        return None
    hp = model.hp
    assert isinstance(hp, MoEHParams)
    e, p = hp.hidden_size, "mtp.layers.0."
    mlp, ffn = load_ffn(ckpt, p, hp, sparse=ckpt.has(p + "mlp.gate.weight"))
    layer = MoELayerWeights("full_attention", norm1p(ckpt, p + "input_layernorm.weight", e),
                            norm1p(ckpt, p + "post_attention_layernorm.weight", e), load_attention(ckpt, p, hp),
                            mlp, ffn)
    fc = load_linear(ckpt, "mtp.fc")
    if tuple(fc.shape) != (e, 2 * e):
        raise CheckpointError(f"mtp.fc: expected shape {[e, 2 * e]}, found {list(fc.shape)}")
    return MTPHead(model, MTPWeights(norm1p(ckpt, "mtp.pre_fc_norm_embedding.weight", e),
                                     norm1p(ckpt, "mtp.pre_fc_norm_hidden.weight", e), fc, layer,
                                     norm1p(ckpt, "mtp.norm.weight", e)))
