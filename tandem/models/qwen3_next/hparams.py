"""Hyper-parameters of Qwen3-Next (flat config.json): the MoE fields plus which layers are sparse.

Source: spec/qwen3_5.md §1.2 (Qwen3-Next paragraph) and transformers' ``Qwen3NextDecoderLayer``: layer i has the
sparse MoE MLP when i is not in ``mlp_only_layers``, ``num_experts`` > 0 and (i + 1) % ``decoder_sparse_step``
== 0, else the dense MLP of width ``intermediate_size``; ``norm_topk_prob`` (default true) renormalises top-k.
"""

from __future__ import annotations

from typing import Any

from tandem.config import ConfigError, require
from tandem.models.qwen3_5_moe.hparams import MoEHParams


class NextHParams(MoEHParams):
    """``MoEHParams`` whose routing reads ``decoder_sparse_step``, ``mlp_only_layers`` and ``norm_topk_prob``."""

    @classmethod
    def routing(cls, t: dict[str, Any], num_layers: int) -> tuple[bool, tuple[bool, ...]]:
        """(norm_topk_prob, sparse_layers). Raises ConfigError for a bad step, layer list or flag."""
        step = require(t, "decoder_sparse_step", int, positive=True, default=1)
        only = t.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ConfigError("config field 'mlp_only_layers' must be a list of layer indices")
        bad = [i for i in only if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(f"config field 'mlp_only_layers' names layer {bad[0]}, outside 0..{num_layers - 1}")
        norm = t.get("norm_topk_prob", True)
        if not isinstance(norm, bool):
            raise ConfigError(f"config field 'norm_topk_prob' must be bool, got {norm!r}")
        return norm, tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))
