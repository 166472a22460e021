"""The Qwen3-Next text model (``Qwen3NextForCausalLM``, flat config.json) on the NumPy reference backend.

The Qwen3.5-MoE adapter with two declared differences: config.json's ``decoder_sparse_step``,
``mlp_only_layers`` and ``norm_topk_prob`` choose each layer's feed-forward and the top-k renormalisation
(tandem/models/qwen3_next/hparams.py), and the GDN projections are stored fused (tandem/models/qwen3_next/gdn.py).
"""

from __future__ import annotations

from tandem.models.qwen3_5_moe.model import Qwen3_5MoeModel
from tandem.models.qwen3_next.gdn import load_next_gdn
from tandem.models.qwen3_next.hparams import NextHParams


class Qwen3NextModel(Qwen3_5MoeModel):
    """Qwen3-Next text model: ``model.*`` / ``lm_head`` / ``mtp.*`` tensors, fused GDN projections."""

    hparams_class = NextHParams
    load_gdn_layer = staticmethod(load_next_gdn)
    backend_name = "Qwen3-Next"
