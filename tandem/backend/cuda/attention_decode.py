"""One decode position of a gated full-attention layer on the GPU, after its projections.
Kernel: cuda/attention_decode.cu (arithmetic shared with tree verify in cuda/attention_common.cuh).

`attention_decode_step`: q/k RMSNorm + partial RoPE at `pos`, k/v appended to the caches at row `pos`, then
attention of the H query heads over cache rows 0..pos (GQA), split into 64-row chunks fixed by absolute position
and combined in order, times σ(gate); a KV head's query heads may be split over several blocks (`head_splits`).
One launch by default (`fused=True`): attn_partial (prep fused in), whose last block to finish for a KV head
(counted in a per-device uint32 array, `counter`) combines that head's G query heads with attn_combine's
arithmetic. `fused=False` keeps the two launches attn_partial + attn_combine; both give the same bits.
`attention_decode` is the plain op with numpy_ops.attention_decode's signature (q already prepared, keys / values
the visible rows), with the same `fused` keyword.

KV rows are float32 or bfloat16 bits (uint16 arrays; the `_bf16` kernel instances): a bf16 row is written rounded to
nearest even (tandem/dtypes.py f32_to_bf16) and widened exactly when read, the new row included, so the arithmetic
is the fp32 path's on the stored values (`reference_step` with `kv_dtype`).

The counter: one zeroed uint32 array per device, allocated on first use outside any launch plan's pool
(loader.persistent) and never freed (a recorded plan keeps its pointer); every fused launch leaves it zeroed.
Fused launches that share it must not run concurrently: issue them on one stream (a launch plan does).

Split output (`split="f16" | "f16p" | "bf16"`): the combine writes the o projection's tensor-core GEMV operand
xs [1, P, H·D] uint16 (gemv.prepare's layout for that kind, P = 2 or 3) instead of y, from the same fp32 values,
so xs == gemv.prepare(y, split) bit for bit and the o projection needs no prepare launch (`split_output` checks
the arguments; attention_tree.py's launchers take the same two keywords).

Reference (`reference`, `reference_step`): numpy_ops.attention_decode; rms_norm + rope_tables + apply_rope +
attention_decode + sigmoid composed as Qwen3_5Model.attention_qkv / _attention. Relative error ≤ 1e-5.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.kv_rows import read_rows, write_rows
from tandem.backend.cuda.attention_args import rotary_args
from tandem.backend.cuda.attention_grid import PX_WARPS, multiprocessors, prefill_grid, px_smem, smem_optin
from tandem.backend.cuda.arrays import f32, i32, kv_suffix, out_or_new, require, require_kv
from tandem.backend.cuda.operand import PARTS, SPLIT_CODE, split_operand
from tandem.backend.cuda.loader import cupy, kernel, persistent, raise_smem_limit
from tandem.backend.cuda.plan import Relaunch

# attn_partial, attn_partial_g1 / _g2 / _g4, each also suffixed _bf16 (ATTN_PARTIAL_KERNEL); the same for several
# slots' decode steps in one launch (attn_partial_slots*, attn_combine_slots: launched by decode_slots.py)
KERNELS = ("attn_partial##SUF", "attn_combine", "attn_partial_slots##SUF", "attn_combine_slots")
CHUNK = 64  # key rows of one split-K chunk (ATTN_CHUNK in cuda/attention_common.cuh)
THREADS = 256
MAX_GROUP = 8
COUNTER_MIN = 64  # entries of a new counter (KV heads of one launch); grown when a launch has more
SPLIT_TARGET = 128  # attn_partial blocks to reach by splitting query heads (about one an SM on an H100 / H200)
COMBINE_WIDTH = 64  # attn_combine's channels (threads) a block: a row's D channels over ceil(D / 64) blocks
# Up to FUSED_MAX_CHUNKS chunks attn_partial combines in its last block per KV head (fused); past them the combine is
# attn_combine over H · D / COMBINE_WIDTH blocks (one block per KV head reading every chunk's partials alone became
# the long context's bottleneck). The same bits either way.
FUSED_MAX_CHUNKS = 64
# From SPLIT_DECODE_MIN_CHUNKS chunks on (None: never) DecodeStep runs the split decode:
# attn_prep_rows, then prefill_partial (decode's chunk arithmetic, cuda/attention_tree.cu) with each block walking a
# run of chunks and loading the next chunk's rows while it computes one (attn_partial's one-chunk blocks load, then
# compute, all at once), then attn_combine: decode's bits too (prefill_partial + attn_combine give decode's bits,
# tests/test_cuda_attention_tree.py; DecodeStep's own: tests/test_cuda_attention_kv.py).
SPLIT_DECODE_MIN_CHUNKS: int | None = 65  # past the fused combine's 64 chunks (docs/performance.md: the engine's decode)


def partial_smem(keys: Any) -> int:
    """attn_partial's dynamic shared memory in bytes: a chunk's V rows, CHUNK × D values of the cache's storage."""
    return CHUNK * int(keys.shape[2]) * int(keys.itemsize)


def combine_shape(rows: int, d: int) -> tuple[tuple[int, int, int], tuple[int]]:
    """attn_combine's (grid, block) for `rows` output rows of head dim `d`: (rows, ceil(d / COMBINE_WIDTH), 1),
    (COMBINE_WIDTH,)."""
    return (rows, -(-d // COMBINE_WIDTH), 1), (COMBINE_WIDTH,)

_counters: dict[int, Any] = {}  # device id -> uint32 [≥ Hkv], zero between launches
_retired: list[Any] = []  # outgrown counters: a recorded launch plan may still point into one


def counter(heads: int) -> Any:
    """This device's fused-decode counter: a uint32 device array of at least `heads` entries, all zero between
    launches (each fused attn_partial launch leaves it so). Allocated zeroed on first use (or when a launch needs
    more entries) under loader.persistent(), so a launch plan recording does not put it in its own pool; an
    outgrown one is kept alive, never reused."""
    cp = cupy()
    dev = int(cp.cuda.Device().id)
    have = _counters.get(dev)
    if have is not None and int(have.shape[0]) >= heads:
        return have
    with persistent():
        new = cp.zeros((max(heads, COUNTER_MIN),), dtype=cp.uint32)
    cp.cuda.get_current_stream().synchronize()  # zeroed before any stream's launch reads it
    if have is not None:
        _retired.append(have)
    _counters[dev] = new
    return new


def head_splits(group: int, blocks: int) -> int:
    """How many blocks share a KV head's G query heads in attn_partial (grid.z): the smallest divisor Z of
    ``group`` with ``blocks`` · Z ≥ SPLIT_TARGET, else ``group`` (one head a block). ``blocks``: Hkv · chunks.
    Short contexts have few chunks, and one block per (KV head, chunk) leaves the GPU nearly idle (27B at position
    128: 12 blocks). Any Z gives the same bits (each head's arithmetic is its own)."""
    for z in range(1, group + 1):
        if group % z == 0 and blocks * z >= SPLIT_TARGET:
            return z
    return group


def partial_kernel(heads: int) -> str:
    """The attn_partial instance for ``heads`` query heads a block: attn_partial_g<GH> for the smallest GH in 1, 2, 4
    that holds them, else attn_partial (up to MAX_GROUP). Its loops over a block's heads run GH times, so the one-head
    blocks of a short context run no idle copies (the same arithmetic a head: the same bits)."""
    for gh in (1, 2, 4):
        if heads <= gh:
            return f"attn_partial_g{gh}"
    return "attn_partial"


def split_output(split: str | None, xs: Any, out: Any, rows: int, width: int) -> tuple[int, Any]:
    """The split keywords of a launcher that may write the o projection's operand: (kind, xs).

    Without split: (0, None); xs must be None. With split "f16" / "f16p" / "bf16" (gemv.PREP_KIND's values):
    (gemv.SPLIT_CODE[split], xs [rows, P, width] uint16, P = gemv.PARTS[split]), allocated when xs is None,
    checked (C-contiguous) otherwise; out must be None (the fp32 output is not written).
    Raises: ValueError on an unknown split, xs without split, out with split or a bad xs.
    """
    if split is None:
        if xs is not None:
            raise ValueError("xs: given without split")
        return 0, None
    if out is not None and split in PARTS:
        raise ValueError("out: a split call writes xs, not out")
    buf = split_operand(split, xs, rows, width, name="xs")  # raises on an unknown split first
    return SPLIT_CODE[split], buf


PARTIAL_NUM_ROWS = 18  # attn_partial's argument index of num_rows (cuda/attention_decode.cu ATTN_PARTIAL_PARAMS)
PARTIAL_FUSED = 20  # attn_partial's argument index of fused
COMBINE_NUM_CHUNKS = 9  # attn_combine's argument index of num_chunks


def _check_heads(h: int, d: int, hkv: int, gate: Any) -> None:
    if hkv < 1 or h % hkv or h // hkv > MAX_GROUP:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({hkv}), at most {MAX_GROUP} a group")
    if d % 32 or d > 256:
        raise ValueError(f"head dim must be a multiple of 32 and ≤ 256, got {d}")
    if gate is not None:
        require("gate", gate, np.float32, (h, d), contiguous=False)
        if gate.strides[1] != 4 or gate.strides[0] % 4:
            raise ValueError("gate: its last axis must be contiguous")


def _launch_args(q: Any, keys: Any, values: Any, num_rows: int, gate: Any, y: Any, prep: tuple[Any, ...] | None,
                 kind: int, xs: Any, fused: bool, parts: tuple[Any, Any, Any]) -> tuple[tuple[Any, ...],
                                                                                        tuple[Any, ...]]:
    """(attn_partial's arguments, attn_combine's) for `_attend` and `DecodeStep`: parts = (part_acc [C, H, D],
    part_m [C, H], part_l [C, H]) float32 for at least ceil(num_rows / CHUNK) chunks C; the combine's num_chunks
    (COMBINE_NUM_CHUNKS) is ceil(num_rows / CHUNK)."""
    h = int(q.shape[0])
    d = int(q.shape[1]) // (2 if prep is not None else 1)
    hkv = int(keys.shape[1])
    part_acc, part_m, part_l = parts
    has_gate = gate is not None
    scale = float(np.float32(1.0 / np.sqrt(d)))
    if prep is None:
        k_new = v_new = q_norm = k_norm = freq = q
        rotary_dim, eps = 0, 0.0
    else:
        k_new, v_new, q_norm, k_norm, freq, rotary_dim, eps = prep
    gate_arg = gate if has_gate else part_m
    stride = gate.strides[0] // 4 if has_gate else 0
    xs_arg = xs if kind else y
    partial = (q, i32(int(q.shape[1])), i32(int(prep is not None)), k_new, v_new, q_norm, k_norm, freq, i32(rotary_dim),
               f32(eps), keys, values, part_acc, part_m, part_l, i32(h), i32(hkv), i32(d), i32(num_rows), f32(scale),
               i32(int(fused)), counter(hkv) if fused else part_m, gate_arg, i32(int(has_gate)), i32(stride), y,
               i32(kind), xs_arg)
    combine = (part_acc, part_m, part_l, gate_arg, i32(int(has_gate)), i32(stride), y, i32(h), i32(d),
               i32(-(-num_rows // CHUNK)), i32(h), i32(kind), xs_arg)
    return partial, combine


def _attend(q: Any, keys: Any, values: Any, num_rows: int, gate: Any, out: Any,
            prep: tuple[Any, ...] | None = None, split: str | None = None, xs: Any = None, fused: bool = True) -> Any:
    """Attention over rows [0, num_rows): attn_partial with its fused combine (one launch), or with `fused` False or
    past FUSED_MAX_CHUNKS chunks attn_partial + attn_combine. q: [H, D], or with `prep` = (k_new, v_new, q_norm,
    k_norm, inv_freq, rotary_dim, eps) the raw qg [H, 2D]: the kernel preps q and writes row num_rows - 1. Returns
    y [H, D] float32 (into `out` if given), or with `split` xs [1, P, H·D] uint16 (`split_output`)."""
    h = int(q.shape[0])
    d = int(q.shape[1]) // (2 if prep is not None else 1)
    hkv = int(keys.shape[1])
    _check_heads(h, d, hkv, gate)
    if not 1 <= num_rows <= keys.shape[0]:
        raise ValueError(f"visible rows {num_rows} outside 1..{keys.shape[0]}")
    cp = cupy()
    chunks = -(-num_rows // CHUNK)
    fused = fused and chunks <= FUSED_MAX_CHUNKS
    parts = (cp.empty((chunks, h, d), dtype=cp.float32), cp.empty((chunks, h), dtype=cp.float32),
             cp.empty((chunks, h), dtype=cp.float32))
    kind, xs = split_output(split, xs, out, 1, h * d)
    y = out_or_new("out", out, (h, d)) if kind == 0 else xs  # the kernel writes one of them
    partial, combine = _launch_args(q, keys, values, num_rows, gate, y, prep, kind, xs, fused, parts)
    z = head_splits(h // hkv, hkv * chunks)
    fn = kernel("attention_decode", partial_kernel(h // hkv // z) + kv_suffix(keys))
    smem = partial_smem(keys)
    raise_smem_limit(fn, smem)
    fn((hkv, chunks, z), (THREADS,), partial, shared_mem=smem)
    if not fused:
        kernel("attention_decode", "attn_combine")(*combine_shape(h, d), combine)
    return y


def attention_decode(q: Any, keys: Any, values: Any, gate: Any = None, out: Any = None, *, split: str | None = None,
                     xs: Any = None, fused: bool = True) -> Any:
    """One query position over the visible rows, GQA; optionally · σ(gate).

    Args: q [H, D] float32; keys, values [S, Hkv, D] float32, or both uint16 (bfloat16 bits, widened exactly) (device,
    contiguous); gate [H, D] float32 or None
    (may be a strided view whose last axis is contiguous); out: optional [H, D] float32.
    split: None, or "f16" / "f16p" / "bf16": write the result as the GEMV operand instead (see the module doc);
    xs: optional [1, P, H·D] uint16 for it (P = 2 for "f16" / "f16p", 3 for "bf16"; "f16" needs |y| < 65504).
    fused: one launch (the default; uses this device's `counter`), or False: attn_partial + attn_combine. The
    same bits either way.
    Returns: [H, D] float32; with split, xs [1, P, H·D] uint16 == gemv.prepare(y.reshape(1, -1), split) bitwise.
    Raises: ValueError on bad shapes / dtypes, an unknown split, xs without split or out with split.
    """
    require("q", q, np.float32, (None, None))
    h, d = (int(s) for s in q.shape)
    require_kv("keys", keys, (None, None, d))
    require_kv("values", values, tuple(keys.shape), like=keys)
    return _attend(q, keys, values, int(keys.shape[0]), gate, out, split=split, xs=xs, fused=fused)


def _step_checks(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                 v_cache: Any, eps: float) -> tuple[int, int, int, tuple[Any, ...]]:
    """attention_decode_step's argument checks: (H, D, cache rows, the kernel's prep tuple)."""
    require("qg", qg, np.float32, (None, None))
    h, d = int(qg.shape[0]), int(qg.shape[1]) // 2
    require_kv("k_cache", k_cache, (None, None, d))
    max_len, hkv = int(k_cache.shape[0]), int(k_cache.shape[1])
    require_kv("v_cache", v_cache, (max_len, hkv, d), like=k_cache)
    require("k_new", k_new, np.float32, (hkv, d))
    require("v_new", v_new, np.float32, (hkv, d))
    rotary_dim = rotary_args(d, q_norm, k_norm, inv_freq)
    return h, d, max_len, (k_new, v_new, q_norm, k_norm, inv_freq, rotary_dim, eps)


def attention_decode_step(qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any,
                          k_cache: Any, v_cache: Any, pos: int, eps: float, out: Any = None, *,
                          split: str | None = None, xs: Any = None, fused: bool = True, rope_shift: int = 0) -> Any:
    """Decode position `pos` of a gated attention layer.

    Args:
        qg: [H, 2D] float32, the q projection (q then gate per head). k_new, v_new: [Hkv, D] float32.
        q_norm, k_norm: [D] float32 (1 + w). inv_freq: [rd/2] float32 (numpy_ops.rope_tables' frequencies).
        k_cache, v_cache: [max_len, Hkv, D] float32, or both uint16 (bfloat16 bits: row `pos` written rounded to
        nearest even, dtypes.f32_to_bf16, and attended to as stored), row `pos` written. pos: absolute position.
        eps: epsilon.
        out: optional [H·D] float32 (C-contiguous), written in place.
        split: None, or "f16" / "f16p" / "bf16" (the o projection's ``prep_kind``): write o_proj's tensor-core
        operand instead of the fp32 output. xs: optional [1, P, H·D] uint16 for it (P = 2 for "f16" / "f16p",
        3 for "bf16"); allocated when None. "f16" needs |y| < 65504, as gemv.prepare.
        fused: one launch, attn_partial with its combine (the default; uses this device's `counter`, so fused
        launches must not run concurrently on two streams), or False: two, attn_partial + attn_combine. The
        outputs and cache rows have the same bits either way.
        rope_shift: q and k rotated at pos + rope_shift, the row still written at pos and rows 0..pos attended (past
        an image prompt every position is index + delta: tandem/models/qwen3_5/mrope.py). 0: the text path,
        unchanged. Nonzero runs ``DecodeStep``'s split decode (attn_prep_rows at pos + rope_shift writing row pos,
        prefill_partial, attn_combine: decode's arithmetic, so the bits a decode at that rotation has, and what
        attention_tree_step with the same rope_shift gives its nodes).
    Returns: [H·D] float32, attention output · σ(gate) (o_proj's input); with split, xs [1, P, H·D] uint16, equal
    bit for bit to gemv.prepare(y.reshape(1, -1), split) (y is not written).
    Raises: ValueError on bad shapes / dtypes, pos outside the cache, an unknown split, xs without split or out
    with split.
    """
    h, d, max_len, prep = _step_checks(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps)
    if not 0 <= pos < max_len:
        raise ValueError(f"pos {pos} outside the cache of {max_len} rows")
    if rope_shift:
        if out is not None:
            require("out", out, np.float32, (h * d,))
        step = DecodeStep(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps, out, split=split, xs=xs,
                          fused=fused)
        step(pos, rope_shift)
        return step.result
    if split is not None:
        return _attend(qg, k_cache, v_cache, pos + 1, qg[:, d:], out, prep, split, xs, fused)
    if xs is not None:
        raise ValueError("xs: given without split")
    if out is not None:  # written in place by the combine (a view, no copy)
        require("out", out, np.float32, (h * d,))
        _attend(qg, k_cache, v_cache, pos + 1, qg[:, d:], out.reshape(h, d), prep, fused=fused)
        return out
    return _attend(qg, k_cache, v_cache, pos + 1, qg[:, d:], None, prep, fused=fused).reshape(-1)


class DecodeStep:
    """``attention_decode_step`` of one layer for a launch plan: the checks, buffers and argument blocks made once,
    then each call launches the step at a given position with little host time (plan.Relaunch: the same kernels
    and arguments as attention_decode_step, so the same bits; programmatic dependent launch where the device has
    it, which the kernels allow: they wait (pdl_wait) before reading anything).

    Args: as attention_decode_step without pos (qg [H, 2D], k_new / v_new [Hkv, D], q_norm / k_norm [D], inv_freq
    [rd/2] float32, the caches [max_len, Hkv, D] float32 or uint16 (bf16 bits), eps; out / split / xs / fused
    likewise); scratch: the
    partials' buffers from ``decode_scratch`` for these caches, shared by the layers of one stream (their launches
    run one after another), or None to allocate them here. Arrays are held (their pointers are in the blocks).
    Call: ``step(pos, rope_shift=0)`` (0 ≤ pos < max_len) writes cache row pos and the result; with fused, past
    FUSED_MAX_CHUNKS chunks the combine runs as its own launch (attn_combine over more blocks), and from
    SPLIT_DECODE_MIN_CHUNKS chunks (when set) the split decode, with the same bits. A nonzero rope_shift (as
    attention_decode_step's) always takes the split decode, its prep rotating at pos + rope_shift (a device whose
    shared memory cannot hold prefill_partial's raises ValueError). ``result``: the output array ([H·D] float32, or with
    split xs [1, P, H·D] uint16).
    Raises: ValueError as attention_decode_step (pos outside the cache at the call), or on a scratch of the wrong
    shape or too few chunks.
    """

    def __init__(self, qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, k_cache: Any,
                 v_cache: Any, eps: float, out: Any = None, *, split: str | None = None, xs: Any = None,
                 fused: bool = True, scratch: tuple[Any, Any, Any] | None = None) -> None:
        h, d, max_len, prep = _step_checks(qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, eps)
        hkv = int(k_cache.shape[1])
        gate = qg[:, d:]
        _check_heads(h, d, hkv, gate)
        if split is None and out is not None:
            require("out", out, np.float32, (h * d,))
        kind, xs = split_output(split, xs, out, 1, h * d)
        y = out_or_new("out", None if out is None else out.reshape(h, d), (h, d)) if kind == 0 else xs
        self.result = y.reshape(-1) if kind == 0 else xs
        parts = scratch if scratch is not None else decode_scratch(k_cache, h)
        chunks = -(-max_len // CHUNK)
        require("scratch part_acc", parts[0], np.float32, (None, h, d))
        require("scratch part_m", parts[1], np.float32, (int(parts[0].shape[0]), h))
        require("scratch part_l", parts[2], np.float32, (int(parts[0].shape[0]), h))
        if int(parts[0].shape[0]) < chunks:
            raise ValueError(f"scratch: {int(parts[0].shape[0])} chunks for a cache of {max_len} rows ({chunks})")
        self.partial, self.combine = _launch_args(qg, k_cache, v_cache, 1, gate, y, prep, kind, xs, fused, parts)
        self.hkv, self.group, self.max_len, self.fused, self.h, self.d = hkv, h // hkv, max_len, fused, h, d
        self.suffix, self.smem = kv_suffix(k_cache), partial_smem(k_cache)
        self._inputs = (qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, parts, eps, prep[5])
        self._split: tuple[Relaunch, Relaunch] | None = None  # the split decode's prep and partials (on first use)
        self.keep = (qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, parts, y, xs)
        self._partials: dict[str, Relaunch] = {}
        self._combine: Relaunch | None = None

    def __call__(self, pos: int, rope_shift: int = 0) -> None:
        if not 0 <= pos < self.max_len or pos + rope_shift < 0:
            raise ValueError(f"pos {pos} (rope shift {rope_shift}) outside the cache of {self.max_len} rows")
        chunks = pos // CHUNK + 1
        if rope_shift:  # rotated elsewhere than the row: only the split decode preps apart from its row
            if px_smem(self.d) > smem_optin():
                raise ValueError("a rotary shift needs the split decode (prefill_partial), whose shared memory this "
                                 "device lacks")
            self._split_decode(pos, chunks, rope_shift)
            return
        split = SPLIT_DECODE_MIN_CHUNKS
        if split is not None and chunks >= split and px_smem(self.d) <= smem_optin():
            self._split_decode(pos, chunks)
            return
        z = head_splits(self.group, self.hkv * chunks)
        name = partial_kernel(self.group // z) + self.suffix
        launch = self._partials.get(name)
        if launch is None:
            fn = kernel("attention_decode", name)
            raise_smem_limit(fn, self.smem)
            launch = self._partials[name] = Relaunch(fn, (self.hkv, chunks, z), (THREADS,), self.partial, self.smem)
        fused = self.fused and chunks <= FUSED_MAX_CHUNKS
        launch.set(PARTIAL_NUM_ROWS, pos + 1)
        if self.fused:
            launch.set(PARTIAL_FUSED, int(fused))
        launch.launch((self.hkv, chunks, z))
        if not fused:
            if self._combine is None:
                self._combine = Relaunch(kernel("attention_decode", "attn_combine"), *combine_shape(self.h, self.d),
                                         self.combine)
            self._combine.set(COMBINE_NUM_CHUNKS, chunks)
            self._combine.launch()


    def _split_decode(self, pos: int, chunks: int, rope_shift: int = 0) -> None:
        """Position `pos` by attn_prep_rows (q prepped and k rotated at pos + rope_shift, k / v rows written at pos),
        prefill_partial over the chunks (one query token, the KV heads' G rows a block, runs of chunks by
        attention_grid.prefill_grid) and attn_combine: decode's bits."""
        h, hkv, d = self.h, self.hkv, self.d
        tile, tiles, per, splits = prefill_grid(1, self.group, hkv, chunks, multiprocessors())
        if self._split is None:
            qg, k_new, v_new, q_norm, k_norm, inv_freq, k_cache, v_cache, parts, eps, rotary_dim = self._inputs
            q = cupy().empty((1, h, d), dtype=np.float32)
            prep = (qg.reshape(1, h, 2 * d), k_new.reshape(1, hkv, d), v_new.reshape(1, hkv, d), q_norm, k_norm,
                    inv_freq, q, i32(0), q, k_cache, v_cache, i32(h), i32(hkv), i32(d), i32(rotary_dim), i32(pos),
                    i32(pos), f32(eps))
            partial = (q, k_cache, v_cache, parts[0], parts[1], parts[2], i32(1), i32(h), i32(hkv), i32(d), i32(pos),
                       f32(float(np.float32(1.0 / np.sqrt(d)))), i32(tile), i32(per), i32(chunks))
            fn = kernel("attention_tree", "prefill_partial" + self.suffix)
            raise_smem_limit(fn, px_smem(d))
            self._split = (Relaunch(kernel("attention_tree", "attn_prep_rows" + self.suffix),
                                    (-(-(h + hkv) // (THREADS // 32)), 1), (THREADS,), prep),
                           Relaunch(fn, (tiles, hkv, splits), (32 * PX_WARPS,), partial, px_smem(d)))
            self._split_q = q  # held: its pointer is in both argument blocks
        prep_step, partial_step = self._split
        prep_step.set(SPLIT_PREP_POS0, pos + rope_shift)
        prep_step.set(SPLIT_PREP_POS0 + 1, pos)  # dst_row0
        prep_step.launch()
        partial_step.set(SPLIT_START, pos)
        partial_step.set(SPLIT_START + 3, per)  # chunks_per_split
        partial_step.set(SPLIT_START + 4, chunks)  # num_chunks
        partial_step.launch((tiles, hkv, splits))
        if self._combine is None:
            self._combine = Relaunch(kernel("attention_decode", "attn_combine"), *combine_shape(h, d), self.combine)
        self._combine.set(COMBINE_NUM_CHUNKS, chunks)
        self._combine.launch()


SPLIT_PREP_POS0 = 15  # attn_prep_rows' argument index of pos0 (dst_row0 follows; cuda/attention_tree.cu)
SPLIT_START = 10  # prefill_partial's argument index of start (tile_tokens, chunks_per_split, num_chunks follow)


def decode_scratch(k_cache: Any, heads: int) -> tuple[Any, Any, Any]:
    """The partials' buffers of a DecodeStep for caches of k_cache's rows and `heads` query heads: (part_acc [C, H,
    D], part_m [C, H], part_l [C, H]) float32, C = ceil(max_len / CHUNK) (allocated from the current pool)."""
    cp = cupy()
    chunks, d = -(-int(k_cache.shape[0]) // CHUNK), int(k_cache.shape[2])
    return (cp.empty((chunks, heads, d), dtype=cp.float32), cp.empty((chunks, heads), dtype=cp.float32),
            cp.empty((chunks, heads), dtype=cp.float32))


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """numpy_ops.attention_decode."""
    return numpy_ops.attention_decode(q, keys, values)


def reference_step(qg: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray,
                   rotary_dim: int, theta: float, k_cache: np.ndarray, v_cache: np.ndarray, pos: int,
                   eps: float, rope_shift: int = 0) -> np.ndarray:
    """The NumPy composition of one attention decode position (caches written at `pos`, q / k rotated at pos +
    rope_shift); returns [H·D]. The caches are float32 or uint16 (bfloat16 bits: kv_rows.write_rows / read_rows,
    the model's KV storage)."""
    h, d = qg.shape[0], qg.shape[1] // 2
    q = numpy_ops.rms_norm(qg[None, :, :d], q_norm, eps)
    gate = qg[None, :, d:].reshape(1, -1)
    k = numpy_ops.rms_norm(k_new[None], k_norm, eps)
    cos, sin = numpy_ops.rope_tables(np.array([pos + rope_shift]), rotary_dim, theta)
    numpy_ops.apply_rope(q, cos, sin)
    numpy_ops.apply_rope(k, cos, sin)
    write_rows(k_cache, pos, k)
    write_rows(v_cache, pos, v_new[None])
    a = numpy_ops.attention_decode(q[0], read_rows(k_cache, pos + 1), read_rows(v_cache, pos + 1))
    return np.asarray(a.reshape(1, -1) * numpy_ops.sigmoid(gate), dtype=np.float32).reshape(-1)


def inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """RoPE inverse frequencies [rd/2] float32, computed as numpy_ops.rope_tables does."""
    return (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32)
                                                     / np.float32(rotary_dim)))).astype(np.float32)
