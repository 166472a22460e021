"""Which slice of every Qwen3.5 text weight each of N tensor-parallel ranks holds (Megatron-style).

Column-parallel (output rows split, no reduction): attention q (per head: D query rows then D gate rows), k, v by
heads; the GDN in-projections by heads (in_proj_qkv's three segments q | k | v each by its heads, in_proj_z by
value heads, in_proj_a / in_proj_b, A_log, dt_bias and the conv channels with them); MLP gate and up by columns;
the embedding and the lm_head by vocabulary rows. Row-parallel (input columns split, partial sums reduced): the
attention o_proj and the GDN out_proj by the heads that feed them, the MLP down_proj by the columns of gate / up.
Norm weights are replicated. A rank's heads are contiguous, so GDN value head j of a rank still reads key head
j // (Hv / Hk) of the same rank. Sources: Shoeybi et al. 2019 (Megatron-LM) §3; spec/qwen3_5.md §2-§3 (tensor
names and layouts).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from tandem.config import ConfigError
from tandem.models.qwen3_5.hparams import HParams

Range = tuple[int, int]

_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.(self_attn|linear_attn|mlp)\.([a-zA-Z0-9_]+)(?:\.(\w+))?$")


@dataclass(frozen=True)
class Split:
    """How one tensor is cut for every rank.

    Attributes:
        axis: 0 (rows: a linear's output dim, or a vector's only dim) or 1 (columns: a linear's input dim).
        size: the logical length of that axis (a linear's out or in features, not its packed or blocked size).
        ranges: per rank, the (start, stop) intervals of the axis it holds, concatenated in this order.
    """

    axis: int
    size: int
    ranges: tuple[tuple[Range, ...], ...]


def _even(size: int, n: int) -> tuple[tuple[Range, ...], ...]:
    """``size`` (a multiple of n) cut into n contiguous equal intervals."""
    step = size // n
    return tuple(((r * step, (r + 1) * step),) for r in range(n))


class ShardPlan:
    """The tensor-parallel layout of one Qwen3.5 model over ``n`` ranks.

    Args:
        hp: the model's hyper-parameters; n: the number of ranks (1: every split is the whole tensor).
    Raises:
        ConfigError: n < 1, or a dimension n does not divide (naming it): attention heads, KV heads, GDN key and
            value heads, the MLP width, the vocabulary.
    """

    def __init__(self, hp: HParams, n: int) -> None:
        if n < 1:
            raise ConfigError(f"tensor parallel size must be at least 1, got {n}")
        dims = {"num_attention_heads": hp.num_attention_heads, "num_key_value_heads": hp.num_key_value_heads,
                "linear_num_key_heads": hp.linear_num_key_heads,
                "linear_num_value_heads": hp.linear_num_value_heads, "intermediate_size": hp.intermediate_size,
                "vocab_size": hp.vocab_size}
        for name, value in dims.items():
            if value % n:
                raise ConfigError(f"tensor parallel size {n} does not divide {name} ({value})")
        self.hp, self.n = hp, n

    def rank_hparams(self) -> HParams:
        """A rank's hyper-parameters: heads, KV heads, GDN heads, MLP width and vocabulary divided by n (what the
        model code sees when it runs one rank's slice). Its eos ids are the full model's (they index the full
        vocabulary)."""
        hp, n = self.hp, self.n
        return dataclasses.replace(
            hp, num_attention_heads=hp.num_attention_heads // n, num_key_value_heads=hp.num_key_value_heads // n,
            linear_num_key_heads=hp.linear_num_key_heads // n,
            linear_num_value_heads=hp.linear_num_value_heads // n, intermediate_size=hp.intermediate_size // n,
            vocab_size=hp.vocab_size // n)

    def vocab_range(self, rank: int) -> Range:
        """The vocabulary rows [start, stop) of the embedding and the head that ``rank`` holds."""
        step = self.hp.vocab_size // self.n
        return rank * step, (rank + 1) * step

    def split(self, name: str) -> Split | None:
        """The Split of checkpoint tensor ``name`` (any of a linear's tensors: weight, packed weight, scales), or
        None when every rank holds all of it (norms, scalars, tensors outside the text model)."""
        hp, n = self.hp, self.n
        if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            if name.startswith("lm_head.") and name.split(".")[-1] not in _LINEAR_TENSORS:
                return None
            return Split(0, hp.vocab_size, _even(hp.vocab_size, n))
        m = _LAYER.search(name)
        if m is None or name.startswith("mtp."):
            return None
        block, module, tensor = m.group(1), m.group(2), m.group(3)
        if tensor is not None and tensor not in _LINEAR_TENSORS:
            return None
        d, kd, vd = hp.head_dim, hp.key_dim, hp.value_dim
        if block == "self_attn":
            if module == "q_proj":
                return Split(0, 2 * hp.num_attention_heads * d, _even(2 * hp.num_attention_heads * d, n))
            if module in ("k_proj", "v_proj"):
                return Split(0, hp.num_key_value_heads * d, _even(hp.num_key_value_heads * d, n))
            if module == "o_proj":
                return Split(1, hp.num_attention_heads * d, _even(hp.num_attention_heads * d, n))
            return None  # q_norm, k_norm
        if block == "linear_attn":
            if module in ("in_proj_qkv", "conv1d"):
                qk, v = kd // n, vd // n
                return Split(0, hp.conv_dim, tuple(
                    ((r * qk, (r + 1) * qk), (kd + r * qk, kd + (r + 1) * qk), (2 * kd + r * v, 2 * kd + (r + 1) * v))
                    for r in range(n)))
            if module == "in_proj_z":
                return Split(0, vd, _even(vd, n))
            if module in ("in_proj_a", "in_proj_b", "A_log", "dt_bias"):
                return Split(0, hp.linear_num_value_heads, _even(hp.linear_num_value_heads, n))
            if module == "out_proj":
                return Split(1, vd, _even(vd, n))
            return None  # the gated norm's weight [dv]
        if module in ("gate_proj", "up_proj"):
            return Split(0, hp.intermediate_size, _even(hp.intermediate_size, n))
        if module == "down_proj":
            return Split(1, hp.intermediate_size, _even(hp.intermediate_size, n))
        return None


# a linear's tensors (spec §9-§10): the weight or its codes, and the scales that follow its rows / columns
_LINEAR_TENSORS = frozenset({"weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_scale_2",
                             "weight_global_scale", "input_scale", "input_global_scale"})
