"""Decode and tree-verify attention on tensor cores over bf16 KV rows (cuda/attention_tc.cu), behind a switch
(``CudaQwen3_5Model.DECODE_ATTENTION = "tensor_cores"``; attention_switch.py's launchers take ``tensor_cores=True``
and come here for bf16 caches). Not the default until measured on the device.

`attention_tc_decode_step` / `TcDecodeStep`: attention_decode_step's arguments and result; two launches,
attn_tc_decode<D> (q / k prep, k / v row written at pos, the partials of every 64-key unit) and attention_decode.cu's
attn_combine (units merged in order, · σ(gate), y or the split operand xs).
`attention_tc_tree_step` / `TcTreeStep`: attention_tree_step's arguments and result; three launches,
attn_prep_rows_bf16 (attention_tree.cu, the node rows), attn_tc_tree<D> (the units below P shared by groups of
TC_NODES nodes, then each node's units from ⌊P / 64⌋ over the cache rows and its path), attn_combine.
Node i's output has the bits of attention_tc_decode_step at position P + depth_i over its path (the kernel's
comment says why). `attention_tc_rows`: the plain op over prepared q (no gate), for the kernel-vs-twin tests.

Arithmetic (the twin `reference_tc_unit` / `reference_tc_decode`, float64 products standing in for the MMAs):
per unit of 64 absolute key positions and query row, q split into bf16 hi + lo (lo = bf16(q - hi)), scores
(hi·k + lo·k) · D^-1/2, m, e = exp(s - m), l = Σ e, e split into bf16 hi + lo, acc = hi·V + lo·V; merged as
attn_combine does. The split keeps the query and the weights to ~2^-17 relative: within 1e-5 of float64 attention
(tests/test_attention_tc_twin.py), where bf16 q and P alone would be ~1e-3.
Reference: `reference_tc_decode` (twin); numpy_ops.attention_decode via attention_decode.reference_step.
Tolerances: kernel vs twin 2e-5 relative (the MMAs' fp32 accumulation order); vs reference_step 2e-4 (as the
cuda-core bf16 path: the new k row's rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda.arrays import f32, i32, out_or_new, require, require_kv
from tandem.backend.cuda.attention_decode import (COMBINE_NUM_CHUNKS, _check_heads, _launch_args, _step_checks,
                                                  combine_shape, decode_scratch, split_output)
from tandem.backend.cuda.attention_grid import multiprocessors, smem_optin
from tandem.backend.cuda.attention_tree import THREADS as PREP_THREADS
from tandem.backend.cuda.attention_tree import PREP_POS0, TreePartials, _prep_args, _tree_indices, _tree_shapes
from tandem.backend.cuda.loader import cupy, kernel, raise_smem_limit
from tandem.backend.cuda.plan import Relaunch
from tandem.dtypes import bf16_to_f32, f32_to_bf16

KERNELS = ("attn_tc_decode##D", "attn_tc_tree##D")  # D = 32, 64, ..., 256 (ATTN_TC_KERNELS)
UNIT = 64  # key positions of a unit (TC_UNIT: attention_common.cuh's ATTN_CHUNK, so attn_combine's chunks)
THREADS = 256
STAGES = 2
TC_NODES = 4  # nodes (tiles) a shared verify block
SC_LD = 72
MAX_GROUP = 8
MAX_NODES = 64
F32 = np.float32

# attn_tc_decode's argument indices (TC_DECODE_PARAMS) and attn_tc_tree's (TC_TREE_PARAMS)
DECODE_NUM_ROWS, DECODE_PER = 16, 18
TREE_PARTS, TREE_START, TREE_SHARED_UNITS, TREE_PER, TREE_SHARED_BLOCKS = 7, 13, 15, 16, 17


def tc_smem(d: int, nodes: int) -> int:
    """Dynamic shared memory in bytes of a block of `nodes` tiles at head dim `d` (cuda/attention_tc.cu tc_smem): the
    K / V rings, the A tiles, the score rows."""
    return (2 * STAGES * UNIT * (d + 8) + nodes * 16 * (d + 8)) * 2 + nodes * 8 * SC_LD * 4


def supported(k_cache: Any, group: int) -> bool:
    """Whether the tensor-core path takes these caches: bf16 rows (uint16), head dim a multiple of 32 up to 256,
    G ≤ 8, and a block's shared memory holding a verify block's (device opt-in limit). fp32 caches keep the
    cuda-core kernels."""
    d = int(k_cache.shape[2])
    return (k_cache.dtype == np.uint16 and d % 32 == 0 and d <= 256 and group <= MAX_GROUP
            and tc_smem(d, TC_NODES) + 1024 <= smem_optin())


def _need_supported(k_cache: Any, group: int) -> None:
    if not supported(k_cache, group):
        raise ValueError(f"tensor-core attention takes bf16 caches, head dim a multiple of 32 ≤ 256, G ≤ 8; got "
                         f"{k_cache.dtype}, head dim {int(k_cache.shape[2])}, G {group}")


def decode_grid(hkv: int, units: int, sms: int) -> tuple[int, int]:
    """(units a block, blocks a KV head) of a decode over `units` units: about one block an SM (one fits). Which
    block takes a unit never changes its bits."""
    per = max(1, -(-units * hkv // sms))
    return per, -(-units // per)


def tree_grid(start: int, chunks: int, nodes: int, hkv: int, sms: int) -> tuple[int, int, int, int]:
    """(shared units c0 = ⌊start / 64⌋, units a shared block, shared blocks, total blocks) of a verify over `chunks`
    units: the node groups' runs of units below P, about one block an SM, then nodes × Hkv × (chunks - c0)."""
    c0 = start // UNIT
    groups = -(-nodes // TC_NODES)
    per = max(1, -(-c0 * hkv * groups // sms)) if c0 else 1
    shared = groups * hkv * -(-c0 // per) if c0 else 0
    return c0, per, shared, shared + nodes * hkv * (chunks - c0)


class TcDecodeStep:
    """attention_decode.DecodeStep on tensor cores (the same arguments; `fused` is ignored: two launches, the
    combine over H · D / 64 blocks). Call: ``step(pos)``; ``result``: [H·D] float32 or with split xs [1, P, H·D].
    Raises: ValueError as DecodeStep, or for caches the tensor-core path does not take (``supported``)."""

    def __init__(self, qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                 v_cache: Any, eps: float, out: Any = None, *, split: str | None = None, xs: Any = None,
                 fused: bool = True, scratch: tuple[Any, Any, Any] | None = None) -> None:
        h, d, max_len, prep = _step_checks(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps)
        hkv = int(k_cache.shape[1])
        gate = qg[:, d:]
        _check_heads(h, d, hkv, gate)
        _need_supported(k_cache, h // hkv)
        if split is None and out is not None:
            require("out", out, np.float32, (h * d,))
        kind, xs = split_output(split, xs, out, 1, h * d)
        y = out_or_new("out", None if out is None else out.reshape(h, d), (h, d)) if kind == 0 else xs
        self.result = y.reshape(-1) if kind == 0 else xs
        parts = scratch if scratch is not None else decode_scratch(k_cache, h)
        require("scratch part_acc", parts[0], np.float32, (None, h, d))
        require("scratch part_m", parts[1], np.float32, (int(parts[0].shape[0]), h))
        require("scratch part_l", parts[2], np.float32, (int(parts[0].shape[0]), h))
        _, combine = _launch_args(qg, k_cache, v_cache, 1, gate, y, prep, kind, xs, False, parts)
        k_new, v_new, q_norm, k_norm, freq, rotary_dim, _ = prep
        partial = (qg, i32(2 * d), k_new, v_new, q_norm, k_norm, freq, i32(rotary_dim), f32(eps), k_cache, v_cache,
                   parts[0], parts[1], parts[2], i32(h), i32(hkv), i32(1), f32(float(F32(1.0 / np.sqrt(d)))), i32(1))
        fn = kernel("attention_tc", f"attn_tc_decode{d}")
        smem = tc_smem(d, 1)
        raise_smem_limit(fn, smem)
        self._partial = Relaunch(fn, (hkv, 1, 1), (THREADS,), partial, smem)
        self._combine = Relaunch(kernel("attention_decode", "attn_combine"), *combine_shape(h, d), combine)
        self.keep = (qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, parts, y, xs)
        self.hkv, self.max_len, self._sms = hkv, max_len, multiprocessors()
        self._units = int(parts[0].shape[0])

    def __call__(self, pos: int) -> None:
        if not 0 <= pos < self.max_len:
            raise ValueError(f"pos {pos} outside the cache of {self.max_len} rows")
        units = pos // UNIT + 1
        if units > self._units:
            raise ValueError(f"scratch: {self._units} chunks, position {pos} needs {units}")
        per, blocks = decode_grid(self.hkv, units, self._sms)
        self._partial.set(DECODE_NUM_ROWS, pos + 1)
        self._partial.set(DECODE_PER, per)
        self._partial.launch((self.hkv, blocks, 1))
        self._combine.set(COMBINE_NUM_CHUNKS, units)
        self._combine.launch()


def attention_tc_decode_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any,
                             k_cache: Any, v_cache: Any, pos: int, eps: float, out: Any = None, *,
                             split: str | None = None, xs: Any = None) -> Any:
    """attention_decode.attention_decode_step on tensor cores (bf16 caches): the same arguments and result ([H·D]
    float32, or with split xs [1, P, H·D] uint16), cache row pos written with its stored bf16 bits.
    Raises: ValueError as attention_decode_step, or for caches the path does not take (``supported``)."""
    require("qg", qg, np.float32, (None, None))
    h, d = int(qg.shape[0]), int(qg.shape[1]) // 2
    require_kv("k_cache", k_cache, (None, None, d))
    max_len = int(k_cache.shape[0])
    if not 0 <= pos < max_len:
        raise ValueError(f"pos {pos} outside the cache of {max_len} rows")
    units = pos // UNIT + 1
    cp = cupy()
    parts = (cp.empty((units, h, d), dtype=cp.float32), cp.empty((units, h), dtype=cp.float32),
             cp.empty((units, h), dtype=cp.float32))
    step = TcDecodeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps, out, split=split, xs=xs,
                        scratch=parts)
    step(pos)
    return step.result


def _tree_partial_args(q: Any, k_cache: Any, v_cache: Any, node_k: Any, node_v: Any, dep: Any, par: Any,
                       parts: tuple[Any, Any, Any], h: int, start: int, shared: tuple[int, int, int]) -> tuple[Any, ...]:
    """attn_tc_tree's arguments (shared = tree_grid's c0, per, shared blocks)."""
    n, d = int(q.shape[0]), int(q.shape[2])
    return (q, k_cache, v_cache, node_k, node_v, dep, par, parts[0], parts[1], parts[2], i32(n), i32(h),
            i32(int(k_cache.shape[1])), i32(start), f32(float(F32(1.0 / np.sqrt(d)))), i32(shared[0]), i32(shared[1]),
            i32(shared[2]))


def _combine_args(parts: tuple[Any, Any, Any], gate: Any, y: Any, rows: int, h: int, d: int, chunks: int, kind: int,
                  xs: Any) -> tuple[Any, ...]:
    """attn_combine's arguments over rows N·H (gate [N, H, ≥ D] with row stride 2D, or None: no gate)."""
    has_gate = gate is not None
    return (parts[0], parts[1], parts[2], gate if has_gate else parts[1], i32(int(has_gate)),
            i32(2 * d if has_gate else 0), y, i32(rows), i32(d), i32(chunks), i32(h), i32(kind), xs if kind else y)


class TcTreeStep:
    """attention_tree.TreeStep on tensor cores: the same arguments (depths / parent_ids device int32 [N], caches and
    node rows bf16 bits), three launches a call (attn_prep_rows_bf16, attn_tc_tree<D>, attn_combine). Call:
    ``step(start)``; ``result``: y [N, H·D] float32 or with split xs [N, P, H·D] uint16.
    Raises: ValueError as TreeStep, or for caches the tensor-core path does not take (``supported``)."""

    def __init__(self, qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                 v_cache: Any, depths: Any, parent_ids: Any, eps: float, node_k: Any, node_v: Any, out: Any = None, *,
                 split: str | None = None, xs: Any = None, partials: TreePartials | None = None) -> None:
        n, h, hkv, d, max_len = _tree_shapes(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, node_k,
                                             node_v)
        _need_supported(k_cache, h // hkv)
        cp = cupy()
        dep, par, _ = _tree_indices(depths, parent_ids, n)
        kind, xs = split_output(split, xs, out, n, h * d)
        y = out_or_new("out", out, (n, h * d)) if kind == 0 else xs
        self.result = y
        self.n, self.h, self.d, self.hkv, self.max_len = n, h, d, hkv, max_len
        self.partials = partials if partials is not None else TreePartials(-(-max_len // UNIT))
        if self.partials.max_chunks * UNIT < max_len:
            raise ValueError(f"partials of {self.partials.max_chunks} chunks for a cache of {max_len} rows")
        q = cp.empty((n, h, d), dtype=np.float32)
        prep_grid, prep = _prep_args(qg, k_new, v_new, q_norm, k_norm, inv_freq, dep, q, node_k, node_v, 0, 0, eps)
        parts = self.partials.parts(1, n * h, d)
        self._prep = Relaunch(kernel("attention_tree", "attn_prep_rows_bf16"), prep_grid, (PREP_THREADS,), prep)
        fn = kernel("attention_tc", f"attn_tc_tree{d}")
        smem = tc_smem(d, TC_NODES)
        raise_smem_limit(fn, smem)
        self._partial = Relaunch(fn, (1, 1, 1), (THREADS,),
                                 _tree_partial_args(q, k_cache, v_cache, node_k, node_v, dep, par, parts, h, 0,
                                                    (0, 1, 0)), smem)
        self._combine = Relaunch(kernel("attention_decode", "attn_combine"), *combine_shape(n * h, d),
                                 _combine_args(parts, qg[:, :, d:], y, n * h, h, d, 1, kind, xs))
        self._parts, self._sms = parts, multiprocessors()
        self.keep = (qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, dep, par, node_k, node_v, y, xs, q)

    def __call__(self, start: int) -> None:
        if not 0 <= start < self.max_len:
            raise ValueError(f"start {start} outside the cache of {self.max_len} rows")
        max_depth = min(self.n - 1, self.max_len - 1 - start)  # device tables: bounded by the node count
        chunks = -(-(start + max_depth + 1) // UNIT)
        parts = self.partials.parts(chunks, self.n * self.h, self.d)
        if parts is not self._parts:  # the shared buffers grew: point the launches at the new ones
            for i, a in enumerate(parts):
                self._partial.set(TREE_PARTS + i, int(a.data.ptr))
                self._combine.set(i, int(a.data.ptr))
            self._parts = parts
        self._prep.set(PREP_POS0, start)
        self._prep.launch()
        c0, per, shared, total = tree_grid(start, chunks, self.n, self.hkv, self._sms)
        for idx, value in ((TREE_START, start), (TREE_SHARED_UNITS, c0), (TREE_PER, per),
                           (TREE_SHARED_BLOCKS, shared)):
            self._partial.set(idx, value)
        self._partial.launch((total, 1, 1))
        self._combine.set(COMBINE_NUM_CHUNKS, chunks)
        self._combine.launch()


def attention_tc_tree_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                           v_cache: Any, start: int, depths: Any, parent_ids: Any, eps: float, node_k: Any,
                           node_v: Any, out: Any = None, *, split: str | None = None, xs: Any = None) -> Any:
    """attention_tree.attention_tree_step on tensor cores (bf16 caches and node rows): the same arguments and result;
    row i equals attention_tc_decode_step at position start + depth_i over its path, bit for bit.
    Raises: ValueError as attention_tree_step, or for caches the path does not take (``supported``)."""
    n = int(qg.shape[0])
    dep, par, max_depth = _tree_indices(depths, parent_ids, n)
    max_len = int(k_cache.shape[0])
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if max_depth < 0:
        max_depth = min(n - 1, max_len - 1 - start)
    if start + max_depth >= max_len:
        raise ValueError(f"tree of depth {max_depth} at start {start} reaches past the cache of {max_len} rows")
    step = TcTreeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, dep, par, eps, node_k, node_v,
                      out, split=split, xs=xs, partials=TreePartials(-(-max_len // UNIT)))
    step(start)
    return step.result


def attention_tc_rows(q: Any, k_cache: Any, v_cache: Any, node_k: Any, node_v: Any, start: int, depths: Sequence[int],
                      parent_ids: Sequence[int]) -> Any:
    """The plain op under the verify kernel: prepared query rows q [N, H, D] float32, node i attending to cache rows
    [0, start) then its path's node rows (node_k / node_v [N, Hkv, D] bf16 bits), no gate; attn_tc_tree then
    attn_combine. Returns [N, H, D] float32 (the kernel-vs-twin tests' op). Raises: ValueError on bad shapes or an
    invalid tree."""
    require("q", q, np.float32, (None, None, None))
    n, h, d = (int(x) for x in q.shape)
    require_kv("k_cache", k_cache, (None, None, d))
    hkv = int(k_cache.shape[1])
    require_kv("v_cache", v_cache, tuple(k_cache.shape), like=k_cache)
    require_kv("node_k", node_k, (n, hkv, d), like=k_cache)
    require_kv("node_v", node_v, (n, hkv, d), like=k_cache)
    _check_heads(h, d, hkv, None)
    _need_supported(k_cache, h // hkv)
    dep, par, max_depth = _tree_indices(depths, parent_ids, n)
    chunks = -(-(start + max_depth + 1) // UNIT)
    cp = cupy()
    parts = (cp.empty((chunks, n * h, d), dtype=cp.float32), cp.empty((chunks, n * h), dtype=cp.float32),
             cp.empty((chunks, n * h), dtype=cp.float32))
    c0, per, shared, total = tree_grid(start, chunks, n, hkv, multiprocessors())
    fn = kernel("attention_tc", f"attn_tc_tree{d}")
    raise_smem_limit(fn, tc_smem(d, TC_NODES))
    fn((total,), (THREADS,), _tree_partial_args(q, k_cache, v_cache, node_k, node_v, dep, par, parts, h, start,
                                                (c0, per, shared)), shared_mem=tc_smem(d, TC_NODES))
    y = cp.empty((n, h, d), dtype=cp.float32)
    kernel("attention_decode", "attn_combine")(*combine_shape(n * h, d),
                                               _combine_args(parts, None, y, n * h, h, d, chunks, 0, None))
    return y


# ---------------------------------------------------------------------------------------------- the NumPy twin
def _bf16(x: np.ndarray) -> np.ndarray:
    """x float32 rounded to bf16 (nearest even, dtypes.f32_to_bf16: the kernel's kv_bf16_bits / cvt.rn), as float32."""
    return bf16_to_f32(f32_to_bf16(np.ascontiguousarray(x, dtype=F32)))


def split_bf16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) float32 with hi = bf16(x), lo = bf16(x - hi) (x - hi exact in float32): hi + lo within 2^-17 |x|."""
    hi = _bf16(x)
    return hi, _bf16((np.asarray(x, F32) - hi).astype(F32))


def reference_tc_unit(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                      scale: np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One unit of attn_tc_*'s arithmetic for G query rows. q [G, D] float32; keys, values [n, D] float32 (stored
    bf16 values), 1 ≤ n ≤ 64. Returns (m [G], l [G], acc [G, D]) float32: the scores (hi·k + lo·k) · scale, each
    product sum in float64 rounded to float32 (the MMA's fp32 accumulation, up to its order), m = max, e = exp(s - m),
    l = Σ e, acc = hi(e)·V + lo(e)·V likewise."""
    hi, lo = split_bf16(q)
    k64, v64 = keys.astype(np.float64), values.astype(np.float64)
    s = ((hi.astype(np.float64) @ k64.T).astype(F32) + (lo.astype(np.float64) @ k64.T).astype(F32)).astype(F32)
    s = (s * F32(scale)).astype(F32)
    m = s.max(axis=1)
    e = np.exp((s - m[:, None]).astype(F32)).astype(F32)
    l = e.sum(axis=1, dtype=F32)
    eh, el = split_bf16(e)
    acc = ((eh.astype(np.float64) @ v64).astype(F32) + (el.astype(np.float64) @ v64).astype(F32)).astype(F32)
    return m, l, acc


def reference_tc_decode(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The twin of the tensor-core decode / a verify row: q [H, D] float32 over keys, values [S, Hkv, D] float32 (the
    stored values, positions 0..S-1), GQA; units of 64 absolute positions merged as attn_combine (M = max m_c,
    w_c = exp(m_c - M), Σ w_c acc_c / Σ w_c l_c, units in order). Returns [H, D] float32."""
    h, d = q.shape
    s, hkv = keys.shape[0], keys.shape[1]
    g = h // hkv
    scale = F32(1.0 / np.sqrt(d))
    out = np.empty((h, d), F32)
    for j in range(hkv):
        parts = [reference_tc_unit(q[j * g:(j + 1) * g], keys[u:u + UNIT, j], values[u:u + UNIT, j], scale)
                 for u in range(0, s, UNIT)]
        m = np.stack([p[0] for p in parts])  # [C, G]
        big = m.max(axis=0)
        w = np.exp((m - big).astype(F32)).astype(F32)
        den = np.zeros(g, F32)
        num = np.zeros((g, d), F32)
        for c, (_, l, acc) in enumerate(parts):
            den = (den + w[c] * l).astype(F32)
            num = (num + w[c][:, None] * acc).astype(F32)
        out[j * g:(j + 1) * g] = (num / den[:, None]).astype(F32)
    return out
