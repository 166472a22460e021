"""The decode / verify attention launchers behind the model's switch (``CudaQwen3_5Model.DECODE_ATTENTION``): each
takes the arguments of its attention_decode.py / attention_tree.py namesake plus ``tensor_cores``; with it, bf16
caches that attention_tc.supported takes run the tensor-core kernels (attention_tc.py), anything else today's
cuda-core kernels. The tensor-core path has its own bits: a caller switches decode and verify together, so verify
rows keep decode's bits (tests/test_cuda_attention_tc.py). A nonzero ``rope_shift`` (an image prompt's rows:
models/qwen3_5/cuda_images.py) always runs the cuda-core kernels, whose split decode rotates apart from the row; a
sequence's shift is the same for its decodes and its verifies, so the two still take one path.
"""

from __future__ import annotations

from typing import Any

from tandem.backend.cuda import attention_decode as ad
from tandem.backend.cuda import attention_tc as tc
from tandem.backend.cuda import attention_tree as at


class _Shifted:
    """A tensor-core step (``step(pos)``) that runs the cuda-core step ``make()`` builds for a call with a nonzero
    rotary shift (``step(pos, rope_shift)``); ``result`` is the same buffer either way (both write out / xs)."""

    def __init__(self, step: Any, make: Any) -> None:
        self.step, self._make = step, make
        self._cuda_cores: Any = None
        self.result = step.result

    def __call__(self, pos: int, rope_shift: int = 0) -> None:
        if not rope_shift:
            self.step(pos)
            return
        if self._cuda_cores is None:
            self._cuda_cores = self._make()
        self._cuda_cores(pos, rope_shift)


def use_tensor_cores(k_cache: Any, heads: int) -> bool:
    """Whether caches `k_cache` [max_len, Hkv, D] with `heads` query heads take the tensor-core path
    (attention_tc.supported: bf16 rows, a head dim it has, G ≤ 8, the device's shared memory)."""
    hkv = int(k_cache.shape[1])
    return heads % hkv == 0 and tc.supported(k_cache, heads // hkv)


def attention_decode_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                          v_cache: Any, pos: int, eps: float, out: Any = None, *, split: str | None = None,
                          xs: Any = None, fused: bool = True, tensor_cores: bool = False, rope_shift: int = 0) -> Any:
    """attention_decode.attention_decode_step, or with ``tensor_cores`` (and caches it takes, and no rope_shift)
    attention_tc.attention_tc_decode_step (``fused`` ignored there). Same arguments, result and errors."""
    if tensor_cores and not rope_shift and use_tensor_cores(k_cache, int(qg.shape[0])):
        return tc.attention_tc_decode_step(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, pos, eps, out,
                                           split=split, xs=xs)
    return ad.attention_decode_step(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, pos, eps, out,
                                    split=split, xs=xs, fused=fused, rope_shift=rope_shift)


def decode_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any, v_cache: Any,
                eps: float, out: Any = None, *, split: str | None = None, xs: Any = None, fused: bool = True,
                scratch: tuple[Any, Any, Any] | None = None,
                tensor_cores: bool = False) -> Any:
    """attention_decode.DecodeStep, or with ``tensor_cores`` (and caches it takes) attention_tc.TcDecodeStep that
    runs a DecodeStep for a shifted call: the same arguments (the same scratch from attention_decode.decode_scratch),
    ``step(pos, rope_shift=0)`` and ``result``."""

    def cuda_cores() -> ad.DecodeStep:
        return ad.DecodeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps, out, split=split,
                             xs=xs, fused=fused, scratch=scratch)

    if tensor_cores and use_tensor_cores(k_cache, int(qg.shape[0])):
        return _Shifted(tc.TcDecodeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps, out,
                                        split=split, xs=xs, scratch=scratch), cuda_cores)
    return ad.DecodeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps, out, split=split, xs=xs,
                         fused=fused, scratch=scratch)


def attention_tree_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                        v_cache: Any, start: int, depths: Any, parent_ids: Any, eps: float, node_k: Any, node_v: Any,
                        out: Any = None, *, split: str | None = None, xs: Any = None,
                        tensor_cores: bool = False, rope_shift: int = 0) -> Any:
    """attention_tree.attention_tree_step, or with ``tensor_cores`` (and caches it takes, and no rope_shift)
    attention_tc.attention_tc_tree_step: row i then equals attention_decode_step with tensor_cores at its position."""
    if tensor_cores and not rope_shift and use_tensor_cores(k_cache, int(qg.shape[1])):
        return tc.attention_tc_tree_step(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, start, depths,
                                         parent_ids, eps, node_k, node_v, out, split=split, xs=xs)
    return at.attention_tree_step(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, start, depths,
                                  parent_ids, eps, node_k, node_v, out, split=split, xs=xs, rope_shift=rope_shift)


def tree_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any, v_cache: Any,
              depths: Any, parent_ids: Any, eps: float, node_k: Any, node_v: Any, out: Any = None, *,
              split: str | None = None, xs: Any = None, partials: at.TreePartials | None = None,
              tensor_cores: bool = False) -> Any:
    """attention_tree.TreeStep, or with ``tensor_cores`` (and caches it takes) attention_tc.TcTreeStep that runs a
    TreeStep for a shifted call: the same arguments (the same TreePartials), ``step(start, rope_shift=0)`` and
    ``result``."""

    def cuda_cores() -> at.TreeStep:
        return at.TreeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, depths, parent_ids, eps,
                           node_k, node_v, out, split=split, xs=xs, partials=partials)

    if tensor_cores and use_tensor_cores(k_cache, int(qg.shape[1])):
        return _Shifted(tc.TcTreeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, depths,
                                      parent_ids, eps, node_k, node_v, out, split=split, xs=xs, partials=partials),
                        cuda_cores)
    return at.TreeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, depths, parent_ids, eps, node_k,
                       node_v, out, split=split, xs=xs, partials=partials)
