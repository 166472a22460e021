"""The MTP head of the MoE members (spec/qwen3_5.md §2.4, §8): the dense ``MTPHead`` with a MoE layer.

``mtp.layers.0`` is one full-attention decoder layer whose MLP is the model type's: a sparse MoE
(``mtp.layers.0.mlp.gate.weight`` present; experts fused or per expert as the main layers) or a dense MLP.
``MTPHead.forward`` runs it through the adapter's ``_mlp``.
"""

from __future__ import annotations

from tandem.checkpoint import Checkpoint
from tandem.models.qwen3_5.host import HostModel
from tandem.models.qwen3_5.mtp import MTPHead, load_mtp
from tandem.models.qwen3_5.weights import LayerWeights, load_attention, norm1p
from tandem.models.qwen3_5_moe.hparams import MoEHParams
from tandem.models.qwen3_5_moe.weights import MoELayerWeights, load_ffn


def load_moe_mtp(model: HostModel) -> MTPHead | None:
    """Load ``mtp.*`` from the model's checkpoint directory (its layer's feed-forward sparse where the checkpoint
    stores a router, else dense); None when the checkpoint has no MTP layer.

    Raises: CheckpointError for a present but malformed MTP layer.
    """
    hp = model.hp
    assert isinstance(hp, MoEHParams)
    e = hp.hidden_size

    def moe_layer(ckpt: Checkpoint, p: str) -> LayerWeights:
        mlp, ffn = load_ffn(ckpt, p, hp, sparse=ckpt.has(p + "mlp.gate.weight"))
        return MoELayerWeights("full_attention", norm1p(ckpt, p + "input_layernorm.weight", e),
                               norm1p(ckpt, p + "post_attention_layernorm.weight", e), load_attention(ckpt, p, hp),
                               mlp, ffn)

    return load_mtp(model, moe_layer)
