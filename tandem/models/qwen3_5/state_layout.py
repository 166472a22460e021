"""A Qwen3.5 sequence's state buffers and the input checks every verb makes, shared by the NumPy model (model.py,
verify.py) and the CUDA model (cuda_model.py), so neither needs the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.dtypes import KV_DTYPES
from tandem.models.qwen3_5.hparams import FULL, HParams
from tandem.models.state import BufferSpec


def state_specs(hp: HParams, max_len: int, kv_dtype: str = "float32") -> list[BufferSpec]:
    """Buffers of one sequence: per GDN layer ``conv`` [K-1, conv_dim] and ``ssm`` [Hv, dk, dv] (sections, float32);
    per attention layer ``k``/``v`` [max_len, Hkv, D] (views) of ``kv_dtype`` ("float32" or "bfloat16": bf16 bits
    in uint16, tandem/backend/kv_rows.py).

    Raises: ValueError for another kv_dtype."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    specs = []
    for i, kind in enumerate(hp.layer_types):
        if kind == FULL:
            shape = (max_len, hp.num_key_value_heads, hp.head_dim)
            specs += [BufferSpec(f"layers.{i}.k", shape, kv_dtype, "view"),
                      BufferSpec(f"layers.{i}.v", shape, kv_dtype, "view")]
        else:
            specs += [BufferSpec(f"layers.{i}.conv", (hp.linear_conv_kernel_dim - 1, hp.conv_dim), "float32",
                                 "section"),
                      BufferSpec(f"layers.{i}.ssm", (hp.linear_num_value_heads, hp.linear_key_head_dim,
                                                     hp.linear_value_head_dim), "float32", "section")]
    return specs


def check_ids(hp: HParams, state: Any, ids: Sequence[int]) -> None:
    """Raise ValueError unless ``ids`` is non-empty, fits the state (``length``, ``max_len``) and lies in the
    vocabulary."""
    if len(ids) == 0:
        raise ValueError("no tokens to process")
    if state.length + len(ids) > state.max_len:
        raise ValueError(f"{state.length + len(ids)} tokens exceed the state's capacity of {state.max_len}")
    bad = [t for t in ids if not 0 <= int(t) < hp.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{hp.vocab_size - 1})")


def check_tree(hp: HParams, state: Any, max_nodes: int, token_ids: Sequence[int], parent_ids: Sequence[int]
               ) -> list[int]:
    """The depth of every node of a draft tree to verify after the state's committed tokens.

    Raises: ValueError on a malformed tree (no node, a parent per node missing, ``parent_ids`` not -1 then in
    [0, i)), more than ``max_nodes`` nodes, a tree past the state's end or a token id outside the vocabulary.
    """
    n = len(token_ids)
    if n == 0 or len(parent_ids) != n:
        raise ValueError(f"a tree needs >= 1 node and one parent per node (got {n} tokens, {len(parent_ids)} parents)")
    if n > max_nodes:
        raise ValueError(f"tree of {n} nodes exceeds the scratch's max_nodes {max_nodes}")
    if parent_ids[0] != -1 or any(not 0 <= parent_ids[i] < i for i in range(1, n)):
        raise ValueError("parent_ids must be -1 for node 0 and in [0, i) for node i")
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parent_ids[i]] + 1
    if state.length + max(depths) >= state.max_len:
        raise ValueError(f"tree reaches position {state.length + max(depths)}; the state holds {state.max_len}")
    bad = [t for t in token_ids if not 0 <= int(t) < hp.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{hp.vocab_size - 1})")
    return depths
