"""Hyper-parameters of the Qwen3.5-MoE text model: the dense fields plus the router and expert sizes.

Source: spec/qwen3_5.md §1.2 (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
``shared_expert_intermediate_size``; ``norm_topk_prob`` / ``decoder_sparse_step`` / ``mlp_only_layers`` are
removed from the Qwen3.5-MoE config: every layer is sparse and the top-k weights are always renormalised) and §7.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.config import ConfigError, RawConfig, require
from tandem.models.qwen3_5.hparams import HParams


@dataclass(frozen=True)
class MoEHParams(HParams):
    """Dense hyper-parameters plus the sparse MLP's.

    Attributes:
        num_experts: routed experts per sparse layer (E). num_experts_per_tok: experts chosen per token (k ≤ E).
        moe_intermediate_size: routed expert SwiGLU width. shared_expert_intermediate_size: shared expert width.
        norm_topk_prob: whether the k chosen probabilities are renormalised to sum to 1.
        sparse_layers: per decoder layer, True for a sparse MoE MLP, False for the dense MLP
            (width ``intermediate_size``, read only when some layer is dense).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]

    @classmethod
    def routing(cls, t: dict[str, Any], num_layers: int) -> tuple[bool, tuple[bool, ...]]:
        """(norm_topk_prob, sparse_layers) from the text config: for Qwen3.5-MoE always (True, all sparse)."""
        return True, (True,) * num_layers

    @classmethod
    def from_config(cls, raw: RawConfig) -> "MoEHParams":
        """Read and validate the text config (the dense checks of ``HParams.from_config``, then the MoE ones).

        Raises:
            ConfigError: a field is missing, mistyped or inconsistent (e.g. ``num_experts_per_tok`` larger than
                ``num_experts``); the message names the field.
        """
        t = dict(raw.text)
        num_layers = require(t, "num_hidden_layers", int, positive=True)
        moe = {name: require(t, name, int, positive=True) for name in (
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}
        norm_topk, sparse = cls.routing(t, num_layers)
        if t.get("intermediate_size") is None:
            if not all(sparse):
                raise ConfigError("config field 'intermediate_size' is missing (needed by the dense MLP layers)")
            t["intermediate_size"] = moe["moe_intermediate_size"]  # never read: no layer has a dense MLP
        base = HParams.from_config(dataclasses.replace(raw, text=t))
        hp = cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(HParams)}, **moe,
                 norm_topk_prob=norm_topk, sparse_layers=sparse)
        if hp.num_experts_per_tok > hp.num_experts:
            raise ConfigError(f"config field 'num_experts_per_tok' ({hp.num_experts_per_tok}) exceeds num_experts "
                              f"({hp.num_experts})")
        return hp
