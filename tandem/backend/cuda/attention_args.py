"""The argument checks the attention launchers share (attention_tree.py, attention_flash.py, vision_mrope.py): the
query / new K / V rows, the norms, the rotary table and the caches of one attention layer (layouts: cuda/attention_tree.cu).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import require, require_kv

MAX_GROUP = 8  # query heads a KV head at most (G ≤ 8: the kernels' per-block row tables)


def rotary_args(d: int, q_norm: Any, k_norm: Any, inv_freq: Any) -> int:
    """Check the q / k norm weights ([D] float32) and the rotary table ([rd/2] float32) of a head dim D; return the
    rotary dims rd. Raises: ValueError on a bad array, or D not a multiple of 32 ≤ 256 holding rd."""
    require("q_norm", q_norm, np.float32, (d,))
    require("k_norm", k_norm, np.float32, (d,))
    require("inv_freq", inv_freq, np.float32, (None,))
    rotary_dim = 2 * int(inv_freq.shape[0])
    if rotary_dim > d or d % 32 or d > 256:
        raise ValueError(f"head dim {d} (multiple of 32, ≤ 256) must hold the rotary dims {rotary_dim}")
    return rotary_dim


def attention_shapes(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
            v_cache: Any) -> tuple[int, int, int, int, int, int]:
    """Check the common arguments; return (rows, H, Hkv, D, rotary_dim, max_len)."""
    require("qg", qg, np.float32, (None, None, None))
    t, h, d = int(qg.shape[0]), int(qg.shape[1]), int(qg.shape[2]) // 2
    require_kv("k_cache", k_cache, (None, None, d))
    max_len, hkv = int(k_cache.shape[0]), int(k_cache.shape[1])
    require_kv("v_cache", v_cache, (max_len, hkv, d), like=k_cache)
    require("k_new", k_new, np.float32, (t, hkv, d))
    require("v_new", v_new, np.float32, (t, hkv, d))
    require("q_norm", q_norm, np.float32, (d,))
    require("k_norm", k_norm, np.float32, (d,))
    require("inv_freq", inv_freq, np.float32, (None,))
    rotary_dim = 2 * int(inv_freq.shape[0])
    if t < 1 or int(qg.shape[2]) != 2 * d:
        raise ValueError(f"qg: expected [T ≥ 1, H, 2D], got {list(qg.shape)}")
    if rotary_dim > d or d % 32 or d > 256:
        raise ValueError(f"head dim {d} (multiple of 32, ≤ 256) must hold the rotary dims {rotary_dim}")
    if hkv < 1 or h % hkv or h // hkv > MAX_GROUP:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv}), at most {MAX_GROUP} a group")
    return t, h, hkv, d, rotary_dim, max_len
