"""A Gated DeltaNet layer over many tokens on the GPU, after its projections: prefill, tree verify and commit.
Kernels: cuda/gdn_seq.cu (spec/qwen3_5.md §4; DESIGN.md, "Branch, undo, restore").

- `gdn_prefill`: T consecutive tokens of one sequence (conv tail and recurrent state updated in place). Three
  launches: prep (conv + L2 norms + gates of all T tokens), scan (the recurrence, state in registers, written back
  once; also shifts the tail), norm (gated RMSNorm of all T outputs).
- `gdn_tree`: N draft-tree nodes, each from its own path (conv window: `tree_ops.tree_windows`; state: its
  parent's after the parent's update). The entry state and tail are only read. Three launches (prep, scan, norm).
  The scan walks the tree depth first (`tree_plan`), saving a state tile in shared memory only at nodes with
  ≥ 2 children and restoring it for their later children; children are visited lightest subtree first, so at most
  floor(log2 N) saved states are held at once (a chain holds none, whatever its depth). A saved state is 8 KiB a
  warp of the block at dk ≥ 64, 4 KiB at 32 (4 warps at Qwen3.5's dk = dv = 128); the device's opt-in shared memory bounds them
  (`max_slots`: 6 on an H200 at dk = dv = 128), so any tree of fewer than 128 nodes fits (verify trees hold ≤ 64);
  a tree needing more raises ValueError.
- `gdn_commit`: replays the accepted path's (k, v, g, beta) kept by `gdn_tree` onto the entry state in place and
  sets the tail to the last K-1 rows of [tail; mixed[path]]. One launch.
- `gdn_decode`: one token in two launches (conv + tail shift a thread a channel; then a block a v-head: L2 norms,
  gates, state update in registers, gated RMSNorm), with the bits of `gdn_prefill` at T = 1: the head kernel
  replays the prep / norm kernels' block_sum orders (blockDim = dv) whatever its own block shape.
- `split`: `gdn_prefill`, `gdn_tree` and `gdn_decode` can write the out projection's operand xs (gemv.prepare's
  layout and bits: "f16", "f16p", "bf16") instead of y, sparing the prepare launch.

Every token gets gdn_step.cu's arithmetic operation for operation (same roundings and reduction trees), so a
prefill equals T decode steps, a tree node equals a decode of its path, a commit equals decoding the path and
`gdn_decode` equals `gdn_prefill` of one token, bit for bit (tests/test_cuda_gdn_seq.py checks it on the GPU).

References (`reference_prefill`, `reference_tree`, `reference_commit`): numpy_ops.causal_conv, l2norm, gdn_gates,
gdn_step (token by token, the recurrent form) and gated_rms_norm composed as Qwen3_5Model.gdn_inputs / _gdn and
verify.py's `_gdn_tree` / `commit`. Tolerance: relative 1e-4 on y, 1e-5 on the state and the per-node rows; the
tail bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.tree_ops import tree_windows
from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.operand import SPLIT_CODE, split_operand
from tandem.backend.cuda.loader import cupy, kernel, raise_smem_limit

KEY_HEAD_SIZES = (32, 64, 128, 256)  # dk with a scan and a decode head kernel (cuda/gdn_seq.cu ScanShape)
KERNELS = ("gdn_seq_prep4", "gdn_seq_prep8", *(f"gdn_seq_scan{d}" for d in KEY_HEAD_SIZES), "gdn_seq_norm",
           "gdn_decode_conv", *(f"gdn_decode_head{d}" for d in KEY_HEAD_SIZES),
           # several slots' decode tokens in one launch each (launched by decode_slots.py)
           "gdn_decode_conv_slots", *(f"gdn_decode_head_slots{d}" for d in KEY_HEAD_SIZES))
SCAN_KERNELS = {d: f"gdn_seq_scan{d}" for d in KEY_HEAD_SIZES}
DECODE_KERNELS = {d: f"gdn_decode_head{d}" for d in KEY_HEAD_SIZES}
SCAN_THREADS = 32
SCAN_ROWS = 64  # most state rows a scan thread holds (min(dk, 64): `_rows`)
SCAN_RING = 4  # visits of inputs in the scan's shared-memory ring (SCAN_RING, ScanRing in cuda/gdn_seq.cu)
# Warps a scan block (SCAN_MAX_WARPS in cuda/gdn_seq.cu), one column group each, sharing one input ring (faster
# than one warp a block: docs/performance.md).
SCAN_MAX_WARPS = 4


def _rows(dk: int) -> int:
    """State rows a scan lane holds (ScanShape::ROWS): min(dk, 64); a saved state is _rows · 32 floats a warp."""
    return min(dk, SCAN_ROWS)


def _cols(dk: int) -> int:
    """State columns a scan warp holds (ScanShape::COLS): 32 / (dk / ROWS) (32 at dk ≤ 64, 16 at 128, 8 at 256)."""
    return SCAN_THREADS // (dk // _rows(dk))


def _scan_warps(dk: int, dv: int) -> int:
    """Warps of a scan block: the most (≤ SCAN_MAX_WARPS) that divide the dv / COLS column groups."""
    groups = dv // _cols(dk)
    return next(w for w in (4, 2, 1) if w <= SCAN_MAX_WARPS and groups % w == 0)


def _ring_bytes(dk: int) -> int:
    """Bytes of the scan's input ring: SCAN_RING slots of k, q [dk], v [SCAN_MAX_WARPS · COLS], 8 words (ScanRing)."""
    return 4 * SCAN_RING * (2 * dk + SCAN_MAX_WARPS * _cols(dk) + 8)


MAX_TAPS = 8
CONV_THREADS = 256  # gdn_decode_conv: one thread a channel
DECODE_MAX_WARPS = 8  # gdn_decode_head: most warps a block (cuda/gdn_seq.cu DECODE_MAX_WARPS)
CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin
NULL = np.uint64(0)  # a null device pointer argument (passed by value; older CuPy mishandles None)


class GDNRows(NamedTuple):
    """Per-token inputs of the delta rule, written by prefill / verify and replayed by commit (device, float32).

    q, k: [N, Hk, dk] (L2-normed; q scaled by dk^-1/2; a v-head h uses k-head h // (Hv / Hk));
    v: [N, Hv, dv]; g, beta: [N, Hv] (log-decay and write strength).
    """

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any


class TreePlan(NamedTuple):
    """The scan's walk of a tree: `order` [N] node ids in depth-first pre-order; `restore` [N] / `save` [N] the
    shared-memory slot the state comes from before / goes to after each visit (-1: none); `num_slots` the most
    slots live at once."""

    order: list[int]
    restore: list[int]
    save: list[int]
    num_slots: int


def new_rows(num_nodes: int, num_k_heads: int, num_v_heads: int, dk: int, dv: int) -> GDNRows:
    """Uninitialised device buffers for `num_nodes` tokens."""
    e = cupy().empty
    return GDNRows(e((num_nodes, num_k_heads, dk), np.float32), e((num_nodes, num_k_heads, dk), np.float32),
                   e((num_nodes, num_v_heads, dv), np.float32), e((num_nodes, num_v_heads), np.float32),
                   e((num_nodes, num_v_heads), np.float32))


def tree_plan(parent_ids: Sequence[int]) -> TreePlan:
    """Depth-first walk of a tree (children lightest subtree first) with its stack of saved states.

    A node with ≥ 2 children saves its state; its first child continues from the registers, later children
    restore the saved state and the last one frees its slot. Slots are used as a stack.
    Raises: ValueError unless parent_ids[0] == -1 and 0 ≤ parent_ids[i] < i.
    """
    n = len(parent_ids)
    if n == 0 or parent_ids[0] != -1 or any(not 0 <= parent_ids[i] < i for i in range(1, n)):
        raise ValueError("parent_ids must be -1 for node 0 and in [0, i) for node i (and name ≥ 1 node)")
    size = [1] * n
    for i in range(n - 1, 0, -1):
        size[parent_ids[i]] += size[i]
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parent_ids[i]].append(i)
    for c in children:
        c.sort(key=lambda x: size[x])  # stable: the heaviest child last, so a held slot at least halves the subtree
    order, restore, save, slot_of = [], [], [], [-1] * n
    live = num_slots = 0
    todo = [0]
    while todo:
        x = todo.pop()
        p = parent_ids[x]
        r = -1
        if p >= 0 and slot_of[p] >= 0 and x != children[p][0]:
            r = slot_of[p]
            if x == children[p][-1]:
                live -= 1
        s = -1
        if len(children[x]) >= 2:
            s, slot_of[x] = live, live
            live += 1
            num_slots = max(num_slots, live)
        order.append(x)
        restore.append(r)
        save.append(s)
        todo.extend(reversed(children[x]))
    return TreePlan(order, restore, save, num_slots)


def max_slots(dk: int, dv: int) -> int:
    """Saved states (a tile a warp) that fit in the current device's opt-in shared memory a scan block, next to the
    input ring: 6 on an H200 at dk = dv = 128 (4 warps), enough for any tree of < 128 nodes."""
    runtime = cupy().cuda.runtime
    optin = int(runtime.deviceGetAttribute(CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, runtime.getDevice()))
    return (optin - _ring_bytes(dk)) // (_scan_warps(dk, dv) * _rows(dk) * SCAN_THREADS * 4)


def _check_layer(mixed: Any, tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any,
                 norm_w: Any, state: Any, num_k_heads: int) -> tuple[int, int, int, int, int]:
    """Shapes of one layer's arguments; returns (N, Hv, dk, dv, K). Raises ValueError."""
    require("state", state, np.float32, (None, None, None))
    hv, dk, dv = (int(s) for s in state.shape)
    if num_k_heads < 1 or hv % num_k_heads:
        raise ValueError(f"num_k_heads ({num_k_heads}) must divide Hv ({hv})")
    if dk not in SCAN_KERNELS:
        raise ValueError(f"dk must be one of {sorted(SCAN_KERNELS)} (a scan kernel per dk), got {dk}")
    if dv % 32 or dv > 1024:
        raise ValueError(f"dv must be a multiple of 32 and ≤ 1024 (one thread a state column), got {dv}")
    channels = 2 * num_k_heads * dk + hv * dv
    require("mixed", mixed, np.float32, (None, channels))
    n = int(mixed.shape[0])
    if n < 1:
        raise ValueError("mixed: need ≥ 1 token")
    require("conv_w", conv_w, np.float32, (channels, None))
    taps = int(conv_w.shape[1])
    if not 2 <= taps <= MAX_TAPS:
        raise ValueError(f"conv_w: need 2 ≤ K ≤ {MAX_TAPS} taps, got {taps}")
    require("tail", tail, np.float32, (taps - 1, channels))
    check_gates(a, b, a_log, dt_bias, z, norm_w, n, hv, dv)
    return n, hv, dk, dv, taps


def check_gates(a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any, norm_w: Any, n: int, hv: int, dv: int) -> None:
    """Check a GDN layer's gate inputs for n rows: a, b [n, Hv], z [n, Hv·dv]; its a_log, dt_bias [Hv] and norm
    weight [dv]; all float32. Raises: ValueError on a bad array."""
    require("a", a, np.float32, (n, hv))
    require("b", b, np.float32, (n, hv))
    require("a_log", a_log, np.float32, (hv,))
    require("dt_bias", dt_bias, np.float32, (hv,))
    require("z", z, np.float32, (n, hv * dv))
    require("norm_w", norm_w, np.float32, (dv,))


def _check_rows(rows: GDNRows, n: int, num_k_heads: int, hv: int, dk: int, dv: int) -> None:
    require("rows.q", rows.q, np.float32, (n, num_k_heads, dk))
    require("rows.k", rows.k, np.float32, (n, num_k_heads, dk))
    require("rows.v", rows.v, np.float32, (n, hv, dv))
    require("rows.g", rows.g, np.float32, (n, hv))
    require("rows.beta", rows.beta, np.float32, (n, hv))


def _prep(mixed: Any, parents: Any, tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any,
          rows: GDNRows, num_k_heads: int, dims: tuple[int, int, int, int, int]) -> None:
    n, hv, dk, dv, taps = dims
    q_scale = float(np.float32(1.0 / np.sqrt(dk)))
    kernel("gdn_seq", "gdn_seq_prep4" if taps <= 4 else "gdn_seq_prep8")(  # window registers for K ≤ 4 / ≤ 8
        (n, num_k_heads), (dv,),
        (mixed, tail, conv_w, parents, a, b, a_log, dt_bias, rows.q, rows.k, rows.v, rows.g, rows.beta,
         i32(mixed.shape[1]), i32(taps), i32(num_k_heads), i32(hv), i32(dk), i32(dv), f32(q_scale)),
        shared_mem=2 * dk * 4)


def _scan(rows: GDNRows, with_q: bool, order: Any, stack: Any, num_visits: int, num_slots: int, state: Any,
          write_state: bool, y: Any, tail: Any, mixed: Any, num_rows: int, num_k_heads: int) -> None:
    hv, dk, dv = (int(s) for s in state.shape)
    cols, warps = _cols(dk), _scan_warps(dk, dv)
    smem = _ring_bytes(dk) + num_slots * warps * _rows(dk) * SCAN_THREADS * 4
    fn = kernel("gdn_seq", SCAN_KERNELS[dk])
    raise_smem_limit(fn, smem)
    fn((hv, dv // (cols * warps)), (warps * SCAN_THREADS,),
       (rows.q if with_q else NULL, rows.k, rows.v, rows.g, rows.beta, order, stack, i32(num_visits), state,
        i32(int(write_state)), y, tail, mixed, i32(num_rows), i32(mixed.shape[1]), i32(tail.shape[0] + 1),
        i32(num_k_heads), i32(hv), i32(dv)),
       shared_mem=smem)


def _split_out(split: str | None, xs: Any, n: int, width: int) -> tuple[int, Any]:
    """(common.cuh SPLIT_* code, xs [n, P, width] uint16 checked or allocated); (0, NULL) when split is None."""
    if split is None:
        if xs is not None:
            raise ValueError("xs: only with a split kind")
        return 0, NULL
    buf = split_operand(split, xs, n, width, name="xs")  # raises on an unknown split first
    return SPLIT_CODE[split], buf


def _norm(y: Any, z: Any, norm_w: Any, n: int, hv: int, dv: int, eps: float, kind: int = 0, xs: Any = NULL) -> None:
    kernel("gdn_seq", "gdn_seq_norm")((n * hv,), (dv,), (y, z, norm_w, xs, i32(dv), i32(hv * dv), i32(kind), f32(eps)))


def gdn_prefill(mixed: Any, tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any,
                norm_w: Any, state: Any, num_k_heads: int, eps: float, out: Any = None,
                rows: GDNRows | None = None, split: str | None = None, xs: Any = None) -> Any:
    """T consecutive tokens of a GDN layer (prefill), recurrent form; three launches.

    Args:
        mixed: [T, C] float32 in_qkv projections (q | k | v), C = 2·Hk·dk + Hv·dv.
        tail: [K-1, C] float32 conv tail, set to the last K-1 rows of [tail; mixed]. conv_w: [C, K] float32.
        a, b: [T, Hv] float32; a_log, dt_bias: [Hv] float32; z: [T, Hv·dv] float32; norm_w: [dv] float32.
        state: [Hv, dk, dv] float32, updated in place. num_k_heads: Hk (divides Hv). eps: RMSNorm epsilon.
        out: optional [T, Hv·dv] float32 for y (with `split`: scratch for the un-normed outputs). rows: optional
            `GDNRows` buffers of T rows (else allocated).
        split: None, or the out projection's operand layout ("f16", "f16p", "bf16": gemv.PREP_KIND's values):
            the norm then writes xs = gemv.prepare(y, split) itself (same bits), sparing that launch.
        xs: optional [T, P, Hv·dv] uint16 for the split (P = 2, or 3 for "bf16"); only with `split`.
    Returns: y [T, Hv·dv] float32 (gated-normed output, out_proj's input), or xs when `split` is given.
    Raises: ValueError on a bad dtype / shape, dk ∉ KEY_HEAD_SIZES (32, 64, 128, 256), dv not a multiple of 32 or
        > 1024, K ∉ [2, 8], an unknown split.
    """
    dims = _check_layer(mixed, tail, conv_w, a, b, a_log, dt_bias, z, norm_w, state, num_k_heads)
    n, hv, dk, dv, _ = dims
    rows = rows if rows is not None else new_rows(n, num_k_heads, hv, dk, dv)
    _check_rows(rows, n, num_k_heads, hv, dk, dv)
    y = out_or_new("out", out, (n, hv * dv))
    kind, xs = _split_out(split, xs, n, hv * dv)
    _prep(mixed, NULL, tail, conv_w, a, b, a_log, dt_bias, rows, num_k_heads, dims)
    _scan(rows, True, NULL, NULL, n, 0, state, True, y, tail, mixed, n, num_k_heads)
    _norm(y, z, norm_w, n, hv, dv, eps, kind, xs)
    return y if split is None else xs


def gdn_decode(mixed: Any, tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any,
               norm_w: Any, state: Any, num_k_heads: int, eps: float, out: Any = None, split: str | None = None,
               xs: Any = None, u: Any = None, conv_done: bool = False) -> Any:
    """One decode token of a GDN layer in two launches, with the bits of `gdn_prefill` at T = 1 (y, state, tail).

    gdn_decode_conv (grid ceil(C / 256), block 256: u = silu(conv), tail shifted in place), then
    gdn_decode_head<dk> (grid Hv, block min(dv / COLS, 8) warps, COLS = 32 (dk ≤ 64), 16 (dk 128) or 8 (dk 256)
    state columns a warp: L2 norms, gates, the state update and the gated RMSNorm of one v-head).

    Args:
        mixed: [1, C] float32 in_qkv projection (q | k | v), C = 2·Hk·dk + Hv·dv. tail: [K-1, C] float32 conv
            tail, shifted up one row in place (its last row := mixed). conv_w: [C, K] float32, 2 ≤ K ≤ 8.
        a, b: [1, Hv] float32; a_log, dt_bias: [Hv] float32; z: [1, Hv·dv] float32; norm_w: [dv] float32.
        state: [Hv, dk, dv] float32, updated in place; dk ∈ {32, 64, 128, 256}, dv a multiple of 32 and ≤ 1024.
        num_k_heads: Hk (divides Hv). eps: RMSNorm epsilon.
        out: optional [1, Hv·dv] float32 for y (not used with `split`).
        split: None, or the out projection's operand layout ("f16", "f16p", "bf16"): writes xs =
            gemv.prepare(y, split) (same bits) instead of y. xs: optional [1, P, Hv·dv] uint16 for it.
        u: optional [1, C] float32 scratch for the conv output (allocated when omitted; pass a kept buffer so a
            launch plan replays the same memory).
        conv_done: `mixed` is already u = silu(conv) and the tail already shifted (the in-projection's GEMV ran the
            conv in its epilogue: gemv ``matmul_conv``): one launch, the head kernel.
    Returns: y [1, Hv·dv] float32, or xs [1, P, Hv·dv] uint16 when `split` is given.
    Raises: ValueError on T ≠ 1, or as `gdn_prefill`.
    """
    n, hv, dk, dv, taps = _check_layer(mixed, tail, conv_w, a, b, a_log, dt_bias, z, norm_w, state, num_k_heads)
    if n != 1:
        raise ValueError(f"mixed: gdn_decode takes one token ([1, C]), got {n} (gdn_prefill takes T)")
    channels = int(mixed.shape[1])
    kind, xs = _split_out(split, xs, 1, hv * dv)
    y = out_or_new("out", out, (1, hv * dv)) if split is None else NULL
    if conv_done:
        u = mixed
    else:
        u = out_or_new("u", u, (1, channels))
        kernel("gdn_seq", "gdn_decode_conv")((-(-channels // CONV_THREADS),), (CONV_THREADS,),
                                             (mixed, tail, conv_w, u, i32(channels), i32(taps)))
    cols = _cols(dk)
    q_scale = float(np.float32(1.0 / np.sqrt(dk)))
    kernel("gdn_seq", DECODE_KERNELS[dk])(
        (hv,), (32 * min(dv // cols, DECODE_MAX_WARPS),),
        (u, a, b, a_log, dt_bias, z, norm_w, state, y, xs, i32(kind), i32(num_k_heads), i32(hv), i32(dv),
         f32(q_scale), f32(eps)))
    return y if split is None else xs


def tree_tables(parent_ids: Sequence[int]) -> tuple[TreePlan, Any]:
    """The DFS plan of a tree and its device table [4, N] int32 (parents, order, restore, save): build once per
    verify and pass to every layer's `gdn_tree` (one host-to-device copy instead of one per layer)."""
    plan = tree_plan(parent_ids)
    table = cupy().asarray(np.asarray([list(parent_ids), plan.order, plan.restore, plan.save], dtype=np.int32))
    return plan, table


def gdn_tree(mixed: Any, parent_ids: Sequence[int], tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any,
             dt_bias: Any, z: Any, norm_w: Any, state: Any, num_k_heads: int, eps: float, out: Any = None,
             rows: GDNRows | None = None, tables: tuple[TreePlan, Any] | None = None, split: str | None = None,
             xs: Any = None) -> tuple[Any, GDNRows]:
    """Tree verify of a GDN layer: every node from its path's conv window and state; three launches.

    Args:
        mixed: [N, C] float32 node projections (their pre-conv rows, kept for commit); parent_ids: [N] host ints,
            -1 then parent_ids[i] < i (tandem/speculative/tree.py; any topological order). tail, state: the round's
            entry conv tail [K-1, C] and state [Hv, dk, dv], only read. a, b: [N, Hv]; z: [N, Hv·dv]; the rest as
            `gdn_prefill`. out: optional [N, Hv·dv] float32 (with `split`: scratch). rows: optional `GDNRows` of N
            rows. tables: `tree_tables(parent_ids)`, when the caller runs several layers over one tree.
        split, xs: as `gdn_prefill` (xs [N, P, Hv·dv] uint16 = gemv.prepare(y, split), written instead of y).
    Returns: (y [N, Hv·dv] float32, or xs with `split`; rows: the nodes' q, k, v, g, beta for `gdn_commit`).
    Raises: ValueError on a malformed tree, a tree needing more saved tiles than `max_slots(dk, dv)`, or as
        `gdn_prefill`.
    """
    plan, table = tables if tables is not None else tree_tables(parent_ids)
    dims = _check_layer(mixed, tail, conv_w, a, b, a_log, dt_bias, z, norm_w, state, num_k_heads)
    n, hv, dk, dv, _ = dims
    if len(parent_ids) != n:
        raise ValueError(f"parent_ids: {len(parent_ids)} entries for {n} nodes")
    if plan.num_slots > max_slots(dk, dv):
        raise ValueError(f"tree needs {plan.num_slots} saved state tiles; shared memory holds {max_slots(dk, dv)}")
    rows = rows if rows is not None else new_rows(n, num_k_heads, hv, dk, dv)
    _check_rows(rows, n, num_k_heads, hv, dk, dv)
    y = out_or_new("out", out, (n, hv * dv))
    kind, xs = _split_out(split, xs, n, hv * dv)
    _prep(mixed, table[0], tail, conv_w, a, b, a_log, dt_bias, rows, num_k_heads, dims)
    _scan(rows, True, table[1], table[2:], n, plan.num_slots, state, False, y, tail, mixed, 0, num_k_heads)
    _norm(y, z, norm_w, n, hv, dv, eps, kind, xs)
    return (y if split is None else xs), rows


def gdn_commit(rows: GDNRows, mixed: Any, path: Sequence[int], tail: Any, state: Any,
               path_device: Any = None) -> None:
    """Commit the accepted path of the last `gdn_tree`: replay its rows onto the entry state; one launch.

    Args:
        rows: the `GDNRows` `gdn_tree` returned; mixed: [N, C] float32, the same pre-conv rows it read.
        path: host node ids from the root, each the parent of the next (the caller checks the chain, as
            qwen3_5/verify.py `commit` does). tail: [K-1, C] float32, set to the last K-1 rows of
            [tail; mixed[path]]. state: [Hv, dk, dv] float32 entry state, updated in place to the path's end.
        path_device: optional int32 device copy of ``path`` (one upload for every layer of a commit).
    Raises: ValueError on an empty path, a node id outside [0, N), or a bad dtype / shape.
    """
    require("state", state, np.float32, (None, None, None))
    hv, dk, dv = (int(s) for s in state.shape)
    if dk not in SCAN_KERNELS:
        raise ValueError(f"dk must be one of {sorted(SCAN_KERNELS)}, got {dk}")
    require("rows.k", rows.k, np.float32, (None, None, dk))
    n, num_k_heads = int(rows.k.shape[0]), int(rows.k.shape[1])
    if num_k_heads < 1 or hv % num_k_heads:
        raise ValueError(f"rows.k's {num_k_heads} k-heads must divide Hv ({hv})")
    _check_rows(rows, n, num_k_heads, hv, dk, dv)
    require("mixed", mixed, np.float32, (n, 2 * num_k_heads * dk + hv * dv))
    require("tail", tail, np.float32, (None, mixed.shape[1]))
    if not 1 <= tail.shape[0] < MAX_TAPS:
        raise ValueError(f"tail: need 1..{MAX_TAPS - 1} rows, got {tail.shape[0]}")
    if not path or any(not 0 <= x < n for x in path):
        raise ValueError(f"path {list(path)} must be non-empty node ids in [0, {n})")
    order = path_device if path_device is not None else cupy().asarray(np.asarray(path, dtype=np.int32))
    _scan(rows, False, order, NULL, len(path), 0, state, True, NULL, tail, mixed, len(path), num_k_heads)


def _qkv(u: np.ndarray, num_k_heads: int, hv: int, dk: int, dv: int) -> tuple[np.ndarray, ...]:
    """q, k [T, Hv, dk] (L2-normed, q scaled, expanded to v-heads) and v [T, Hv, dv], as gdn_inputs."""
    t, kd, r = u.shape[0], num_k_heads * dk, hv // num_k_heads
    q = numpy_ops.l2norm(u[:, :kd].reshape(t, num_k_heads, dk))
    q = (q * np.float32(1.0 / np.sqrt(dk))).astype(np.float32)
    k = numpy_ops.l2norm(u[:, kd:2 * kd].reshape(t, num_k_heads, dk))
    return np.repeat(q, r, axis=1), np.repeat(k, r, axis=1), u[:, 2 * kd:].reshape(t, hv, dv)


def reference_prefill(mixed: np.ndarray, tail: np.ndarray, conv_w: np.ndarray, a: np.ndarray, b: np.ndarray,
                      a_log: np.ndarray, dt_bias: np.ndarray, z: np.ndarray, norm_w: np.ndarray, state: np.ndarray,
                      num_k_heads: int, eps: float) -> np.ndarray:
    """NumPy prefill of T tokens, recurrent form (tail and state updated in place); returns y [T, Hv·dv]."""
    hv, dk, dv = state.shape
    window = np.concatenate([tail, mixed])
    u = numpy_ops.causal_conv(window, conv_w)
    tail[...] = window[window.shape[0] - tail.shape[0]:]
    q, k, v = _qkv(u, num_k_heads, hv, dk, dv)
    g, beta = numpy_ops.gdn_gates(a, b, a_log, dt_bias)
    o = np.stack([numpy_ops.gdn_step(state, q[t], k[t], v[t], g[t], beta[t]) for t in range(mixed.shape[0])])
    return numpy_ops.gated_rms_norm(o, z.reshape(o.shape), norm_w, eps).reshape(o.shape[0], -1)


def reference_tree(mixed: np.ndarray, parent_ids: Sequence[int], tail: np.ndarray, conv_w: np.ndarray,
                   a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, z: np.ndarray,
                   norm_w: np.ndarray, state: np.ndarray, num_k_heads: int, eps: float
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """NumPy tree verify as verify.py `_gdn_tree` (tail and state only read).

    Returns: y [N, Hv·dv], k [N, Hv, dk] (expanded to v-heads), v [N, Hv, dv], g, beta [N, Hv]; all float32.
    """
    hv, dk, dv = state.shape
    n = mixed.shape[0]
    win = tree_windows(tail, mixed, list(parent_ids))  # each node's path window, as the host verify builds it
    acc = win[:, 0] * conv_w[:, 0]  # the multiply-add order of numpy_ops.causal_conv
    for j in range(1, conv_w.shape[1]):
        acc = acc + win[:, j] * conv_w[:, j]
    q, k, v = _qkv(numpy_ops.silu(acc.astype(np.float32, copy=False)), num_k_heads, hv, dk, dv)
    g, beta = numpy_ops.gdn_gates(a, b, a_log, dt_bias)
    states = np.empty((n, hv, dk, dv), np.float32)
    o = np.empty((n, hv, dv), np.float32)
    for i in range(n):
        np.copyto(states[i], state if parent_ids[i] < 0 else states[parent_ids[i]])
        o[i] = numpy_ops.gdn_step(states[i], q[i], k[i], v[i], g[i], beta[i])
    y = numpy_ops.gated_rms_norm(o, z.reshape(o.shape), norm_w, eps).reshape(n, -1)
    return y, k, v, g, beta


def reference_commit(k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, mixed: np.ndarray,
                     path: Sequence[int], tail: np.ndarray, state: np.ndarray) -> None:
    """NumPy commit as verify.py `commit` (replay=True): tail and state updated in place. k: [N, Hv, dk]."""
    history = np.concatenate([tail, mixed[np.asarray(path, dtype=np.int64)]])
    tail[...] = history[history.shape[0] - tail.shape[0]:]
    for node in path:
        numpy_ops.gdn_step(state, k[node], k[node], v[node], g[node], beta[node])
