"""Hyper-parameters of the Qwen3.5 dense text model, read and validated from config.json.

Source: spec/qwen3_5.md §1.2 (fields, defaults) and §1.3 (``layer_types`` from ``full_attention_interval``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.config import ConfigError, RawConfig, require

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class HParams:
    """Qwen3.5 text hyper-parameters (shape letters as in STYLE.md).

    E hidden, F MLP width, V vocab, H/Hkv/D attention heads and head dim, Hk/Hv/dk/dv GDN heads and head dims,
    K conv taps, rd rotary dims.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    attn_output_gate: bool
    eos_token_ids: tuple[int, ...]

    @property
    def rotary_dim(self) -> int:
        """Channels of each q/k head that RoPE rotates (the first ``rotary_dim``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        """GDN q (or k) width: Hk · dk."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """GDN v width: Hv · dv."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: 2 · key_dim + value_dim."""
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_config(cls, raw: RawConfig) -> "HParams":
        """Read and validate the text config.

        Raises:
            ConfigError: a field is missing, mistyped or inconsistent; the message names the field.
        """
        t = raw.text
        ints = {
            name: require(t, name, int, positive=True)
            for name in (
                "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim",
            )
        }
        head_dim = require(t, "head_dim", int, positive=True,
                           default=ints["hidden_size"] // ints["num_attention_heads"])
        rope: dict[str, Any] = t.get("rope_parameters") or t.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError("config field 'rope_parameters' must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"config field 'rope_parameters.rope_type' {rope_type!r} is not supported")
        theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
        prf = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))
        layer_types = cls._layer_types(t, ints["num_hidden_layers"])
        eps = require(t, "rms_norm_eps", float, positive=True, default=1e-6)
        eos = raw.generation.get("eos_token_id", t.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        hp = cls(
            head_dim=head_dim, rms_norm_eps=eps, rope_theta=theta, partial_rotary_factor=prf,
            max_position_embeddings=require(t, "max_position_embeddings", int, positive=True, default=32768),
            layer_types=layer_types,
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            attn_output_gate=bool(t.get("attn_output_gate", True)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **ints,
        )
        hp._validate()
        return hp

    @staticmethod
    def _layer_types(t: dict[str, Any], num_layers: int) -> tuple[str, ...]:
        types = t.get("layer_types")
        if types is None:
            interval = require(t, "full_attention_interval", int, positive=True, default=4)
            return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(f"config field 'layer_types' must list {num_layers} layers (num_hidden_layers)")
        for i, kind in enumerate(types):
            if kind not in (LINEAR, FULL):
                raise ConfigError(f"config field 'layer_types[{i}]' is {kind!r}; expected {LINEAR!r} or {FULL!r}")
        return tuple(types)

    def _validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config field 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"config field 'linear_num_key_heads' ({self.linear_num_key_heads}) must divide "
                f"linear_num_value_heads ({self.linear_num_value_heads})")
        rd = self.rotary_dim
        if not 0.0 < self.partial_rotary_factor <= 1.0 or rd % 2 or rd == 0:
            raise ConfigError(
                f"config field 'partial_rotary_factor' ({self.partial_rotary_factor}) must give an even rotary "
                f"dim in (0, head_dim={self.head_dim}]")
        if not self.attn_output_gate:
            raise ConfigError("config field 'attn_output_gate' must be true for Qwen3.5 (gated attention)")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(f"config field 'eos_token_id' ({eos}) is outside the vocabulary ({self.vocab_size})")
