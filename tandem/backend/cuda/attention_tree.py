"""Gated full attention for many new rows on the GPU: tree verify and prefill, after the q / k / v projections.
Kernels: cuda/attention_tree.cu (and attention_decode.cu's attn_combine, shared with decode); the arithmetic of
q / k prep, scores, softmax and the V sum is cuda/attention_common.cuh's, shared with decode.

`attention_tree_step`: N draft nodes, node i at position P + depth_i, attends to cache rows [0, P) and its path
(ancestors and itself, from `parent_ids`). Node K / V rows go to scratch, not the cache; `attention_commit`
copies the accepted path into the cache afterwards. Chunking and reduction order are those of
attention_decode_step (absolute 64-row chunks), so node i gets the bits of a decode at its position over its
path (DESIGN.md, row invariance). Three launches: attn_prep_rows, tree_partial, attn_combine (attention_decode.cu); from
SHARED_MIN_CHUNKS chunks wholly below P on, prefill_partial takes those chunks for every node at once (the same
chunk arithmetic, so the same bits) and tree_partial only the chunks from ⌊P / 64⌋ (`shared_chunks`).

KV rows (the caches and the node rows) are float32 or bfloat16 bits (uint16, every row array of one call the same):
the `_bf16` kernel instances round rows when they write them and widen them when they read them.

`attention_prefill_step`: T tokens at start..start+T-1, K / V written to the cache, causal attention with
decode's arithmetic (prefill_partial: decode's absolute 64-row chunks, its score, softmax and V-sum order, a block
sharing each chunk's K / V rows among up to 72 query rows), output gate: row t has the bits of
attention_decode_step at position start + t. Three launches (for T ≤ 64, the engine's pieces): attn_prep_rows,
prefill_partial (the chunks' partials), attn_combine (attention_decode.cu: a row's chunks merged in order,
· σ(gate)). ``exact=False`` runs the fp32 flash kernel prefill_attn instead (256-key chunks, online softmax: close
to decode, not bitwise), the baseline bench/prefill_attention.py measures exactness against.

Split output (`split="f16" | "f16p" | "bf16"`, both steps): the last kernel (attn_combine / prefill_attn) writes
the o projection's tensor-core GEMV operand xs [rows, P, H·D] uint16 instead of y, from the same fp32 values, so
xs == gemv.prepare(y, split) bit for bit and the o projection needs no prepare launch
(attention_decode.split_output checks the keywords).

References (`reference_tree`, `reference_prefill`): numpy_ops.rms_norm, rope_tables, apply_rope, attention_decode
/ attention_prefill and sigmoid, composed as Qwen3_5Model.attention_qkv / _attention and verify._attention_tree
(spec/qwen3_5.md §5). Tolerances: tree relative error ≤ 1e-5, prefill ≤ 1e-4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.kv_rows import read_rows, round_rows, write_rows
from tandem.backend.cuda.attention_args import MAX_GROUP as MAX_GROUP
from tandem.backend.cuda.attention_args import attention_shapes as _shapes
from tandem.backend.cuda.arrays import f32, i32, kv_suffix, out_or_new, require, require_kv
from tandem.backend.cuda.attention_grid import PX_TOKENS, PX_WARPS, px_smem
from tandem.backend.cuda.attention_grid import multiprocessors as _multiprocessors
from tandem.backend.cuda.attention_grid import prefill_grid as _prefill_grid
from tandem.backend.cuda.attention_grid import smem_optin as _smem_optin
from tandem.backend.cuda.attention_decode import COMBINE_NUM_CHUNKS, attention_decode_step, combine_shape, split_output
from tandem.backend.cuda.loader import cupy, kernel, raise_smem_limit
from tandem.backend.cuda.plan import Relaunch

# each for fp32 KV rows and, suffixed _bf16, for bf16 rows (arrays.kv_suffix)
KERNELS = ("attn_prep_rows##SUF", "tree_partial##SUF", "prefill_partial##SUF", "prefill_attn##SUF",
           "attn_commit_rows##SUF")
CHUNK = 64  # key rows of one split-K chunk (ATTN_CHUNK in cuda/attention_common.cuh), as attention_decode
THREADS = 256
PREP_HEADS = THREADS // 32  # attn_prep_rows: one warp per (row, head)
MAX_NODES = 64
# tree_partial: one node (G ≤ MAX_GROUP query rows) a block; its dynamic shared memory holds a chunk's V rows, and
# the node rows' K and V are fetched in one round trip (not in dependent loads).
PF_BK = 32
# prefill_attn's split-K chunk: keys [PF_KC c, PF_KC (c + 1)) by absolute position (PF_KC in cuda/attention_tree.cu),
# merged by attn_combine; a launch takes at most PF_ROWS query rows, so its partials stay [ceil(P / 256), 256 · H, D].
PF_KC = 256
PF_ROWS = 256
# Query rows of a prefill_attn block (8 warps × PF_RM in cuda/attention_tree.cu): 4 rows a warp, 2 blocks an SM, as
# fast as the other shapes measured for a 27B prefill (docs/performance.md) and spilling no register.
PF_BQ = 32




PREP_POS0 = 15  # attn_prep_rows' argument index of pos0 (cuda/attention_tree.cu)
PARTIAL_PARTS = 7  # tree_partial's argument index of part_acc (part_m, part_l follow)
PARTIAL_START = 14  # tree_partial's argument index of start
PARTIAL_CHUNK0 = 16  # tree_partial's argument index of chunk0 (its first chunk; those before: prefill_partial's)
SHARED_PARTS, SHARED_START, SHARED_TILE, SHARED_PER_SPLIT, SHARED_CHUNKS = 3, 10, 12, 13, 14  # prefill_partial's


def _tree_shapes(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                 v_cache: Any, node_k: Any, node_v: Any) -> tuple[int, int, int, int, int]:
    """A tree verify's argument checks (``_shapes``, the node rows [N, Hkv, D] float32, N ≤ MAX_NODES); returns
    (N, H, Hkv, D, max_len)."""
    n, h, hkv, d, _, max_len = _shapes(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache)
    require_kv("node_k", node_k, (n, hkv, d), like=k_cache)
    require_kv("node_v", node_v, (n, hkv, d), like=k_cache)
    if n > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} tree nodes, got {n}")
    return n, h, hkv, d, max_len


def _prep_args(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, depths: Any, q: Any,
               k_dst: Any, v_dst: Any, pos0: int, dst_row0: int, eps: float) -> tuple[tuple[int, int], tuple[Any, ...]]:
    """attn_prep_rows' grid and arguments (q: its [T, H, D] float32 output)."""
    t, h, d = int(qg.shape[0]), int(qg.shape[1]), int(qg.shape[2]) // 2
    hkv, rd = int(k_new.shape[1]), 2 * int(inv_freq.shape[0])
    has_depths = depths is not None
    return (-(-(h + hkv) // PREP_HEADS), t), (
        qg, k_new, v_new, q_norm, k_norm, inv_freq, depths if has_depths else q, i32(int(has_depths)), q, k_dst,
        v_dst, i32(h), i32(hkv), i32(d), i32(rd), i32(pos0), i32(dst_row0), f32(eps))


def _prep(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, depths: Any, k_dst: Any,
          v_dst: Any, pos0: int, dst_row0: int, eps: float) -> Any:
    t, h, d = int(qg.shape[0]), int(qg.shape[1]), int(qg.shape[2]) // 2
    q = cupy().empty((t, h, d), dtype=np.float32)
    grid, args = _prep_args(qg, k_new, v_new, q_norm, k_norm, inv_freq, depths, q, k_dst, v_dst, pos0, dst_row0, eps)
    kernel("attention_tree", "attn_prep_rows" + kv_suffix(k_dst))(grid, (THREADS,), args)
    return q


def _tree_args(q: Any, qg: Any, k_cache: Any, v_cache: Any, node_k: Any, node_v: Any, dep: Any, par: Any,
               parts: tuple[Any, Any, Any], start: int, chunks: int, y: Any, kind: int,
               xs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(tree_partial's arguments, attn_combine's) for `attention_tree_step` and `TreeStep`: parts = (part_acc [C,
    N·H, D], part_m, part_l [C, N·H]) float32, C ≥ chunks."""
    n, h, d = int(qg.shape[0]), int(qg.shape[1]), int(qg.shape[2]) // 2
    hkv = int(k_cache.shape[1])
    part_acc, part_m, part_l = parts
    scale = float(np.float32(1.0 / np.sqrt(d)))
    partial = (q, k_cache, v_cache, node_k, node_v, dep, par, part_acc, part_m, part_l, i32(n), i32(h), i32(hkv),
               i32(d), i32(start), f32(scale), i32(shared_chunks(start, n, d)))
    combine = (part_acc, part_m, part_l, qg[:, :, d:], i32(1), i32(2 * d), y, i32(n * h), i32(d), i32(chunks), i32(h),
               i32(kind), xs if kind else y)
    return partial, combine


def _tree_indices(depths: Any, parent_ids: Any, n: int) -> tuple[Any, Any, int]:
    """depths / parent_ids as device int32 [N] and the deepest depth (-1: unknown, for device arrays)."""
    cp = cupy()
    if isinstance(depths, cp.ndarray) or isinstance(parent_ids, cp.ndarray):
        require("depths", depths, np.int32, (n,))
        require("parent_ids", parent_ids, np.int32, (n,))
        return depths, parent_ids, -1  # the caller bounds it by the cache (device arrays are trusted)
    dep, par = [int(x) for x in depths], [int(x) for x in parent_ids]
    if len(dep) != n or len(par) != n:
        raise ValueError(f"depths / parent_ids: expected {n} entries, got {len(dep)} / {len(par)}")
    for i in range(n):
        ok = par[i] == -1 and dep[i] == 0 if i == 0 else 0 <= par[i] < i and dep[i] == dep[par[i]] + 1
        if not ok:
            raise ValueError(f"node {i}: parent {par[i]}, depth {dep[i]} do not form a tree rooted at node 0")
    return cp.asarray(dep, dtype=cp.int32), cp.asarray(par, dtype=cp.int32), max(dep)


def attention_tree_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                        v_cache: Any, start: int, depths: Any, parent_ids: Any, eps: float, node_k: Any,
                        node_v: Any, out: Any = None, *, split: str | None = None, xs: Any = None,
                        rope_shift: int = 0) -> Any:
    """Verify N tree nodes of a gated attention layer: node i at position start + depths[i].

    Args:
        qg: [N, H, 2D] float32, the q projection (q then gate per head). k_new, v_new: [N, Hkv, D] float32.
        q_norm, k_norm: [D] float32 (1 + w). inv_freq: [rd/2] float32 (attention_decode.inv_freq).
        k_cache, v_cache: [max_len, Hkv, D] float32, or uint16 (bf16 bits); rows [0, start) are read, none is
        written.
        start: P, the committed length. depths, parent_ids: [N] int32 device arrays (trusted) or host int
        sequences (checked: parent_ids[0] = -1, parent_ids[i] < i, depth = parent's + 1). eps: RMSNorm epsilon.
        node_k, node_v: [N, Hkv, D] of the caches' dtype, written: the nodes' normed, rotated k rows and v rows (as
        stored: rounded to bf16 for bf16 caches).
        out: optional [N, H·D] float32.
        split: None, or "f16" / "f16p" / "bf16" (the o projection's ``prep_kind``): write o_proj's tensor-core
        operand instead of y. xs: optional [N, P, H·D] uint16 for it (P = 2 for "f16" / "f16p", 3 for "bf16");
        allocated when None. "f16" needs |y| < 65504, as gemv.prepare.
        rope_shift: the nodes' rotary positions are start + depths[i] + rope_shift (past an image prompt: index +
        delta, tandem/models/qwen3_5/mrope.py); their rows and the keys they see stay at start + depths[i]. 0: the
        text path, unchanged. Row i then equals attention_decode_step with the same rope_shift.
    Returns: [N, H·D] float32: attention output · σ(gate), o_proj's input; row i equals attention_decode_step at
    position P + depth_i over cache rows [0, P) then node i's path rows, bit for bit (same chunks, same order).
    With split: xs [N, P, H·D] uint16, equal bit for bit to gemv.prepare(y, split) (y is not written); row i of
    it equals attention_decode_step's split output at that position. Three launches either way.
    Layout: node_k[i] is the row that a commit of node i puts at cache row P + depths[i].
    Raises: ValueError on bad shapes / dtypes, N > 64, an invalid host tree, P + max depth beyond the cache, an
    unknown split, xs without split or out with split.
    """
    n, h, hkv, d, max_len = _tree_shapes(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, node_k, node_v)
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    kind, xs = split_output(split, xs, out, n, h * d)
    dep, par, max_depth = _tree_indices(depths, parent_ids, n)
    if max_depth < 0:  # device arrays: at most N - 1, and no node sits past the cache
        max_depth = min(n - 1, max_len - 1 - start)
    if start + max_depth >= max_len:  # node i sits at position start + depth_i
        raise ValueError(f"tree of depth {max_depth} at start {start} reaches past the cache of {max_len} rows")
    if start + rope_shift < 0:
        raise ValueError(f"rope_shift {rope_shift} puts position {start} before 0")
    q = _prep(qg, k_new, v_new, q_norm, k_norm, inv_freq, dep, node_k, node_v, start + rope_shift, 0, eps)
    chunks = -(-(start + max_depth + 1) // CHUNK)
    cp = cupy()
    parts = (cp.empty((chunks, n * h, d), dtype=cp.float32), cp.empty((chunks, n * h), dtype=cp.float32),
             cp.empty((chunks, n * h), dtype=cp.float32))
    y = out_or_new("out", out, (n, h * d)) if kind == 0 else xs  # the kernel writes one of them
    partial, combine = _tree_args(q, qg, k_cache, v_cache, node_k, node_v, dep, par, parts, start, chunks, y, kind, xs)
    suffix, c0 = kv_suffix(k_cache), shared_chunks(start, n, d)
    if c0:  # the chunks below start: every node sees all their rows, so one block serves many nodes' query rows
        fn, smem, grid, args = _shared_launch(q, k_cache, v_cache, parts, n, h, hkv, d, start, c0)
        fn(grid, (32 * PX_WARPS,), args, shared_mem=smem)
    fn = kernel("attention_tree", "tree_partial" + suffix)
    smem_bytes = 4 * CHUNK * d  # a chunk's V rows
    raise_smem_limit(fn, smem_bytes)
    fn((n, hkv, chunks - c0), (THREADS,), partial, shared_mem=smem_bytes)
    kernel("attention_decode", "attn_combine")(*combine_shape(n * h, d), combine)
    return y


# A tree verify at a committed length P computes the chunks wholly below P (every node sees all their rows) with
# prefill_partial, which shares each chunk's K / V among the tiles' query rows (tokens × G heads), instead of
# tree_partial, whose blocks (one a node) each read every chunk again; both run decode's chunk arithmetic
# (attention_common.cuh), so a node's bits do not depend on which kernel took a chunk. tree_partial keeps the chunks
# holding node rows. From SHARED_MIN_CHUNKS such chunks on (shorter caches: the launch more costs more than it saves).
SHARED_MIN_CHUNKS = 16


def shared_chunks(start: int, nodes: int, d: int) -> int:
    """How many of a tree verify's first chunks prefill_partial takes at committed length `start` (0: none): the
    chunks wholly below `start` when there are at least SHARED_MIN_CHUNKS of them and a block's shared memory holds
    prefill_partial's (`_smem_optin`; query rows of ≤ PX_TOKENS nodes a launch)."""
    c0 = start // CHUNK
    if c0 < SHARED_MIN_CHUNKS or nodes > PX_TOKENS or px_smem(d) > _smem_optin():
        return 0
    return c0


def _shared_launch(q: Any, k_cache: Any, v_cache: Any, parts: tuple[Any, Any, Any], n: int, h: int, hkv: int, d: int,
                   start: int, c0: int) -> tuple[Any, int, tuple[int, int, int], tuple[Any, ...]]:
    """prefill_partial over chunks [0, c0) of a tree's N query rows (all below `start`): (kernel, shared bytes, grid,
    arguments); it writes those chunks' partials in tree_partial's layout [C, N·H(, D)]."""
    fn = kernel("attention_tree", "prefill_partial" + kv_suffix(k_cache))
    smem = px_smem(d)
    raise_smem_limit(fn, smem)
    tile, tiles, per_split, splits = _prefill_grid(n, h // hkv, hkv, c0, _multiprocessors())
    scale = float(np.float32(1.0 / np.sqrt(d)))
    args = (q, k_cache, v_cache, parts[0], parts[1], parts[2], i32(n), i32(h), i32(hkv), i32(d), i32(start),
            f32(scale), i32(tile), i32(per_split), i32(c0))
    return fn, smem, (tiles, hkv, splits), args


class TreeStep:
    """``attention_tree_step`` of one layer for a launch plan, with the tree tables on the device: the checks,
    buffers and argument blocks made once; each call launches the three kernels for a committed length `start`
    with little host time (plan.Relaunch: the same kernels and arguments as attention_tree_step, so the same
    bits; programmatic dependent launch where the device has it: the kernels wait before reading what the launch
    before wrote, and tree_partial reads the cache rows early, cuda/common.cuh PDL rule 2).

    Args: as attention_tree_step with depths and parent_ids device int32 [N] arrays and without start (qg [N, H,
    2D], k_new / v_new [N, Hkv, D], q_norm / k_norm [D], inv_freq, caches [max_len, Hkv, D], eps, node_k / node_v
    [N, Hkv, D] float32; out / split / xs likewise); partials: a ``TreePartials`` for these caches that the layers of
    one sequence share (their launches run one after another on one stream), or None for one of its own. Arrays are
    held.
    Call: ``step(start, rope_shift=0)`` (0 ≤ start < max_len; rope_shift as attention_tree_step's). ``result``: y
    [N, H·D] float32, or with split xs [N, P, H·D].
    Raises: ValueError as attention_tree_step (at construction; a start outside the cache at the call).
    """

    def __init__(self, qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                 v_cache: Any, depths: Any, parent_ids: Any, eps: float, node_k: Any, node_v: Any, out: Any = None, *,
                 split: str | None = None, xs: Any = None, partials: TreePartials | None = None) -> None:
        n, h, hkv, d, max_len = _tree_shapes(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, node_k,
                                             node_v)
        cp = cupy()
        if not isinstance(depths, cp.ndarray) or not isinstance(parent_ids, cp.ndarray):
            raise ValueError("depths, parent_ids: TreeStep takes device int32 arrays")
        dep, par, _ = _tree_indices(depths, parent_ids, n)
        kind, xs = split_output(split, xs, out, n, h * d)
        y = out_or_new("out", out, (n, h * d)) if kind == 0 else xs
        self.result = y
        self.n, self.h, self.d, self.max_len = n, h, d, max_len
        self.partials = partials if partials is not None else TreePartials(-(-max_len // CHUNK))
        if self.partials.max_chunks * CHUNK < max_len:
            raise ValueError(f"partials of {self.partials.max_chunks} chunks for a cache of {max_len} rows")
        q = cp.empty((n, h, d), dtype=np.float32)
        prep_grid, prep = _prep_args(qg, k_new, v_new, q_norm, k_norm, inv_freq, dep, q, node_k, node_v, 0, 0, eps)
        parts = self.partials.parts(1, n * h, d)
        partial, combine = _tree_args(q, qg, k_cache, v_cache, node_k, node_v, dep, par, parts, 0, 1, y, kind, xs)
        self.keep = (qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, dep, par, node_k, node_v, y, xs, q)
        suffix = kv_suffix(k_cache)
        self._prep = Relaunch(kernel("attention_tree", "attn_prep_rows" + suffix), prep_grid, (THREADS,), prep)
        fn = kernel("attention_tree", "tree_partial" + suffix)
        smem = 4 * CHUNK * d  # a chunk's V rows
        raise_smem_limit(fn, smem)
        self._partial = Relaunch(fn, (n, hkv, 1), (THREADS,), partial, smem)
        self._combine = Relaunch(kernel("attention_decode", "attn_combine"), *combine_shape(n * h, d), combine)
        self._hkv, self._parts = hkv, parts
        self._q, self._caches = q, (k_cache, v_cache)
        self._shared: Relaunch | None = None  # prefill_partial over the chunks below start (shared_chunks)

    def __call__(self, start: int, rope_shift: int = 0) -> None:
        if not 0 <= start < self.max_len or start + rope_shift < 0:
            raise ValueError(f"start {start} (rope shift {rope_shift}) outside the cache of {self.max_len} rows")
        max_depth = min(self.n - 1, self.max_len - 1 - start)  # device tables: bounded by the node count
        chunks = -(-(start + max_depth + 1) // CHUNK)
        parts = self.partials.parts(chunks, self.n * self.h, self.d)
        if parts is not self._parts:  # the shared buffers grew: point the launches at the new ones
            for i, a in enumerate(parts):
                self._partial.set(PARTIAL_PARTS + i, int(a.data.ptr))
                self._combine.set(i, int(a.data.ptr))
                if self._shared is not None:
                    self._shared.set(SHARED_PARTS + i, int(a.data.ptr))
            self._parts = parts
        self._prep.set(PREP_POS0, start + rope_shift)
        self._prep.launch()
        c0 = shared_chunks(start, self.n, self.d)
        if c0:
            fn, smem, grid, args = _shared_launch(self._q, self._caches[0], self._caches[1], parts, self.n, self.h,
                                                  self._hkv, self.d, start, c0)
            if self._shared is None:
                self._shared = Relaunch(fn, grid, (32 * PX_WARPS,), args, smem)
            for idx in (SHARED_START, SHARED_TILE, SHARED_PER_SPLIT, SHARED_CHUNKS):
                self._shared.set(idx, int(args[idx]))
            self._shared.launch(grid)
        self._partial.set(PARTIAL_START, start)
        self._partial.set(PARTIAL_CHUNK0, c0)
        self._partial.launch((self.n, self._hkv, chunks - c0))
        self._combine.set(COMBINE_NUM_CHUNKS, chunks)
        self._combine.launch()


class TreePartials:
    """The partials' buffers (part_acc [C, R, D], part_m / part_l [C, R] float32) that the TreeSteps of one sequence
    share (their launches run one after another on one stream), grown to the most chunks C (at most ``max_chunks``:
    the cache's) and rows R · D asked for so far. A buffer outgrown goes back to CuPy's pool: the launches still
    queued that read it run before any later launch on the stream that reuses its memory, and every TreeStep points
    its argument blocks at the new buffers before its next launch."""

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        self._have: tuple[Any, Any, Any] | None = None
        self._size = (0, 0, 0)

    def parts(self, chunks: int, rows: int, d: int) -> tuple[Any, Any, Any]:
        """Buffers holding at least `chunks` × `rows` × `d` floats (the kernels index [c, r, d] with the launch's R
        and D, so one allocation of enough floats serves any (R, D)). Raises ValueError past ``max_chunks``."""
        if chunks > self.max_chunks:
            raise ValueError(f"{chunks} attention chunks: the cache has {self.max_chunks}")
        c0, r0, d0 = self._size
        if self._have is not None and chunks <= c0 and rows * d <= r0 * d0 and rows <= r0:
            return self._have
        cp = cupy()
        c, r, dd = min(max(chunks, 2 * c0), self.max_chunks), max(rows, r0), max(d, d0)
        self._have = None  # the old buffers back to the pool before the new ones are taken
        self._have = (cp.empty((c, r, dd), dtype=cp.float32), cp.empty((c, r), dtype=cp.float32),
                      cp.empty((c, r), dtype=cp.float32))
        self._size = (c, r, dd)
        return self._have


def attention_prefill_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any,
                           k_cache: Any, v_cache: Any, start: int, eps: float, out: Any = None, *,
                           split: str | None = None, xs: Any = None, exact: bool = True, mrope: Any = None) -> Any:
    """Prefill T tokens at positions start..start+T-1 of a gated attention layer.

    Args: qg [T, H, 2D], k_new / v_new [T, Hkv, D], q_norm / k_norm [D], inv_freq [rd/2], k_cache / v_cache
    [max_len, Hkv, D] (rows start..start+T-1 written; float32, or uint16 bf16 bits), the rest float32, on the
    device; start ≥ 0; eps; out: optional
    [T, H·D] float32. split: None, or "f16" / "f16p" / "bf16" (the o projection's ``prep_kind``): write o_proj's
    tensor-core operand instead of y; xs: optional [T, P, H·D] uint16 for it (P = 2 for "f16" / "f16p", 3 for
    "bf16"), allocated when None. "f16" needs |y| < 65504, as gemv.prepare. exact: True (the default) runs
    prefill_partial, decode's arithmetic; False the fp32 flash kernel prefill_attn (256-key chunks, an online
    softmax over 32-key tiles: within 1e-4 of decode, not bitwise; kept as the measure of what exactness costs,
    bench/prefill_attention.py). mrope: None (the text path: row t rotated at start + t), or a
    vision_mrope.MRopeRows of T rows: an image prompt's rows, each rotated at its own 3-D position (the prep is
    vision_mrope.mrope_prep; attention and the rest as without), causal by sequence index as ever.
    Returns: [T, H·D] float32, causal attention over rows [0, start + t] · σ(gate); with split, xs [T, P, H·D]
    uint16, equal bit for bit to gemv.prepare(y, split) (y is not written). A row's bits depend on its position
    only (absolute key chunks), not on T or start; with exact, row t equals attention_decode_step at position
    start + t over the same cache rows, bit for bit (the same 64-row chunks, in-chunk order and combine). Launches:
    attn_prep_rows, then per PX_TOKENS (exact) or PF_ROWS tokens the partials kernel and attn_combine; the exact
    partials take ceil((start + T) / 64) · min(T, 64) · H · (D + 2) floats of the CuPy pool while they run. On a
    device whose shared memory a block cannot hold prefill_partial's, exact runs attention_decode_step per token.
    Raises: ValueError on bad shapes / dtypes, start + T beyond the cache, an unknown split, xs without split or
    out with split.
    """
    t, h, hkv, d, _, max_len = _shapes(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache)
    if not 0 <= start or start + t > max_len:
        raise ValueError(f"start {start} with {t} tokens outside the cache of {max_len} rows")
    kind, xs = split_output(split, xs, out, t, h * d)
    if exact and px_smem(d) > _smem_optin():
        if mrope is not None:
            raise ValueError("3-D rotary positions need prefill_partial, whose shared memory this device lacks")
        return _prefill_by_decode(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, start, eps, out,
                                  split, xs)
    if mrope is not None:
        from tandem.backend.cuda.vision_mrope import mrope_prep

        q = mrope_prep(qg, k_new, v_new, q_norm, k_norm, inv_freq, mrope, k_cache, v_cache, start, eps)
    else:
        q = _prep(qg, k_new, v_new, q_norm, k_norm, inv_freq, None, k_cache, v_cache, start, start, eps)
    y = out_or_new("out", out, (t, h * d)) if kind == 0 else xs  # the kernel writes one of them
    scale = float(np.float32(1.0 / np.sqrt(d)))
    cp = cupy()
    if exact:
        group = h // hkv
        smem_bytes = px_smem(d)
        fn = kernel("attention_tree", "prefill_partial" + kv_suffix(k_cache))
        step, key_chunk = PX_TOKENS, CHUNK
    else:
        smem_bytes = 4 * (PF_BQ * d + 2 * PF_BK * (d + 4) + PF_BQ * PF_BK)
        fn = kernel("attention_tree", "prefill_attn" + kv_suffix(k_cache))
        step, key_chunk = PF_ROWS, PF_KC
    raise_smem_limit(fn, smem_bytes)
    for r0 in range(0, t, step):  # bounded partials: [C, rows · H, D] floats
        n = min(step, t - r0)
        chunks = -(-(start + r0 + n) // key_chunk)
        part_acc = cp.empty((chunks, n * h, d), dtype=cp.float32)
        part_m = cp.empty((chunks, n * h), dtype=cp.float32)
        part_l = cp.empty((chunks, n * h), dtype=cp.float32)
        args = (q[r0:r0 + n], k_cache, v_cache, part_acc, part_m, part_l, i32(n), i32(h), i32(hkv), i32(d),
                i32(start + r0), f32(scale))
        if exact:
            tile, tiles, per_split, splits = _prefill_grid(n, group, hkv, chunks, _multiprocessors())
            fn((tiles, hkv, splits), (32 * PX_WARPS,), args + (i32(tile), i32(per_split), i32(chunks)),
               shared_mem=smem_bytes)
        else:
            fn((-(-n // PF_BQ), h, chunks), (THREADS,), args, shared_mem=smem_bytes)
        dst = y[r0:r0 + n] if kind == 0 else xs
        kernel("attention_decode", "attn_combine")(*combine_shape(n * h, d), (
            part_acc, part_m, part_l, qg[r0:r0 + n, :, d:], i32(1), i32(2 * d), dst, i32(n * h), i32(d), i32(chunks),
            i32(h), i32(kind), xs[r0:r0 + n] if kind else dst))  # rows r0.. of C-contiguous xs: a pointer offset
    return y


def _prefill_by_decode(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                       v_cache: Any, start: int, eps: float, out: Any, split: str | None, xs: Any) -> Any:
    """The exact prefill on a device whose shared memory a block cannot hold prefill_partial's (221 KiB at head dim
    256): attention_decode_step token by token (decode itself, so the same bits; T launches). Arguments checked."""
    t, hd = int(qg.shape[0]), int(qg.shape[1]) * (int(qg.shape[2]) // 2)
    y = out_or_new("out", out, (t, hd)) if split is None else xs
    for i in range(t):
        if split is None:
            attention_decode_step(qg[i], k_new[i], v_new[i], q_norm, k_norm, inv_freq, k_cache, v_cache, start + i,
                                  eps, out=y[i])
        else:
            attention_decode_step(qg[i], k_new[i], v_new[i], q_norm, k_norm, inv_freq, k_cache, v_cache, start + i,
                                  eps, split=split, xs=xs[i:i + 1])
    return y


COMMIT_START = 5  # attn_commit_rows' argument index of start (cuda/attention_tree.cu)


def attention_commit(k_cache: Any, v_cache: Any, node_k: Any, node_v: Any, start: int,
                     path_rows: Sequence[int], path_device: Any = None) -> None:
    """Copy the accepted path's node rows to cache rows start, start + 1, ... (one launch: attn_commit_rows).

    Args: k_cache, v_cache [max_len, Hkv, D]; node_k, node_v [N, Hkv, D] (float32, or all uint16); path_rows: node ids
    from the root, each the parent of the next (not checked here; verify.commit checks the chain); path_device:
    optional int32 device copy of path_rows (one upload for every layer of a commit).
    Raises: ValueError when a row is outside [0, N), the path runs past the cache, or on bad shapes / dtypes.
    """
    n, max_len = int(node_k.shape[0]), int(k_cache.shape[0])
    rows = [int(r) for r in path_rows]
    if any(not 0 <= r < n for r in rows) or start < 0 or start + len(rows) > max_len:
        raise ValueError(f"path {rows} (of {n} nodes) at start {start} outside the cache of {max_len} rows")
    if not rows:
        return
    grid, args = _commit_args(k_cache, v_cache, node_k, node_v, path_device, rows, start)
    kernel("attention_tree", "attn_commit_rows" + kv_suffix(k_cache))(grid, (THREADS,), args)


def _commit_args(k_cache: Any, v_cache: Any, node_k: Any, node_v: Any, path_device: Any, rows: Sequence[int],
                 start: int) -> tuple[tuple[int, int], tuple[Any, ...]]:
    """attn_commit_rows' grid and arguments, checked (path_device None: `rows` uploaded)."""
    require_kv("k_cache", k_cache, (None, None, None))
    hkv, d = int(k_cache.shape[1]), int(k_cache.shape[2])
    require_kv("v_cache", v_cache, tuple(k_cache.shape), like=k_cache)
    require_kv("node_k", node_k, (None, hkv, d), like=k_cache)
    require_kv("node_v", node_v, tuple(node_k.shape), like=k_cache)
    if (hkv * d * k_cache.itemsize) % 16 or any(a.data.ptr % 16 for a in (k_cache, v_cache, node_k, node_v)):
        raise ValueError(f"cache rows of {hkv} x {d} values: need a multiple of 16 bytes, 16-byte aligned")
    if path_device is None:
        path_device = cupy().asarray(np.asarray(rows, dtype=np.int32))
    require("path_device", path_device, np.int32, (len(rows),))
    return (len(rows), 2), (k_cache, v_cache, node_k, node_v, path_device, i32(start), i32(hkv * d))


class CommitStep:
    """``attention_commit`` of one layer for a launch plan: a path of `num` rows read from the device int32 array
    `path_device` (rewritten by the caller before each call), the argument block built once; each call copies the
    rows to cache rows start .. start + num - 1 with little host time (plan.Relaunch, PDL where the device has
    it). Args: k_cache, v_cache [max_len, Hkv, D], node_k, node_v [N, Hkv, D] float32 (held; Hkv · D a multiple of
    4, 16-byte aligned); path_device int32 [num] (held; node ids in [0, N), trusted: the caller checks the path).
    Call: ``step(start)``.
    Raises: ValueError on bad shapes / dtypes (construction) or a path past the cache (call)."""

    def __init__(self, k_cache: Any, v_cache: Any, node_k: Any, node_v: Any, path_device: Any, num: int) -> None:
        if num < 1:
            raise ValueError(f"a commit of {num} rows")
        grid, args = _commit_args(k_cache, v_cache, node_k, node_v, path_device, [0] * num, 0)
        self.keep, self.num, self.max_len = args, num, int(k_cache.shape[0])
        self._launch = Relaunch(kernel("attention_tree", "attn_commit_rows" + kv_suffix(k_cache)), grid, (THREADS,),
                                args)

    def __call__(self, start: int) -> None:
        if start < 0 or start + self.num > self.max_len:
            raise ValueError(f"{self.num} rows at start {start} outside the cache of {self.max_len} rows")
        self._launch.set(COMMIT_START, start)
        self._launch.launch()


def _qkv(qg: np.ndarray, k_new: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, positions: np.ndarray,
         rotary_dim: int, theta: float, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = qg.shape[2] // 2
    q = numpy_ops.rms_norm(qg[:, :, :d], q_norm, eps)
    k = numpy_ops.rms_norm(k_new, k_norm, eps)
    cos, sin = numpy_ops.rope_tables(positions, rotary_dim, theta)
    numpy_ops.apply_rope(q, cos, sin)
    numpy_ops.apply_rope(k, cos, sin)
    return q, k, qg[:, :, d:].reshape(qg.shape[0], -1)


def reference_tree(qg: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray,
                   rotary_dim: int, theta: float, k_cache: np.ndarray, v_cache: np.ndarray, start: int,
                   parent_ids: Sequence[int], eps: float) -> tuple[np.ndarray, np.ndarray]:
    """verify._attention_tree in NumPy: returns (y [N, H·D], node_k [N, Hkv, D] float32: the values the node rows
    hold in the caches' storage); the caches (float32, or uint16 bfloat16 bits) are not written."""
    n = qg.shape[0]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parent_ids[i]] + 1
    q, k, gate = _qkv(qg, k_new, q_norm, k_norm, start + np.asarray(depths), rotary_dim, theta, eps)
    a = np.empty(q.shape, np.float32)
    k, v = round_rows(k, k_cache.dtype), round_rows(v_new, v_cache.dtype)
    for i in range(n):
        path = [i]
        while parent_ids[path[-1]] >= 0:
            path.append(parent_ids[path[-1]])
        rows = path[::-1]
        keys = np.concatenate([read_rows(k_cache, start), k[rows]])
        values = np.concatenate([read_rows(v_cache, start), v[rows]])
        a[i] = numpy_ops.attention_decode(q[i], keys, values)
    return np.asarray(a.reshape(n, -1) * numpy_ops.sigmoid(gate), dtype=np.float32), k


def reference_prefill(qg: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, q_norm: np.ndarray,
                      k_norm: np.ndarray, rotary_dim: int, theta: float, k_cache: np.ndarray, v_cache: np.ndarray,
                      start: int, eps: float) -> np.ndarray:
    """Qwen3_5Model._attention's prefill path in NumPy (caches, float32 or uint16 bfloat16 bits, written at
    start..); returns [T, H·D]."""
    t = qg.shape[0]
    q, k, gate = _qkv(qg, k_new, q_norm, k_norm, np.arange(start, start + t), rotary_dim, theta, eps)
    write_rows(k_cache, start, k)
    write_rows(v_cache, start, v_new)
    a = numpy_ops.attention_prefill(q, read_rows(k_cache, start + t), read_rows(v_cache, start + t), start)
    return np.asarray(a.reshape(t, -1) * numpy_ops.sigmoid(gate), dtype=np.float32)
