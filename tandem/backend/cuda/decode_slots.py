"""Several sequences' decode steps in one launch a layer: the joint pass's attention and GDN update over S slots.
Kernels: cuda/attention_decode.cu (attn_partial_slots*, attn_combine_slots) and cuda/gdn_seq.cu
(gdn_decode_conv_slots, gdn_decode_head_slots<dk>).

`AttentionSlots`: the decode attention of S slots (each its own K / V caches, position and rotary shift) for each
attention layer of a pass in at most two launches: attn_partial_slots, grid (Hkv, max_s C_s, Z · S), whose block
(j, c, s · Z + z) runs attn_partial's block (j, c, z) of slot s (the same ``attn_partial_impl``: its prep at pos +
rope_shift, its 64-row chunks on absolute positions, its in-order sums), then, for the slots it did not combine,
attn_combine_slots, grid (H, ceil(D / 64), S), attn_combine's blocks of slot s (the same ``combine_rows``). A slot's
blocks past its own C_s = pos // 64 + 1 chunks exit, so slots of different lengths share one launch.
`GDNSlots`: the GDN decode update of S slots (each its own conv tail and recurrent state) in two launches a layer,
gdn_decode_conv's and gdn_decode_head's blocks of each slot (grid.y = slot) through the same device functions.

Exactness: a slot's blocks run, operation for operation, the blocks of its own decode launch with its own pointers
(attention_decode.attention_decode_step / DecodeStep, gdn_seq.gdn_decode), so its outputs, cache rows, tail and
state have the bits of that slot decoded alone, whatever the other slots are (how many, how long, in which order).
Its partials have their own region (from its first chunk in the table); its fused combine counts in its own
counter entries. The split Z of a KV head's query heads follows the whole launch's blocks (any Z: the same bits).
A slot past 64 chunks (or with a nonzero rotary shift) runs through attn_partial here where DecodeStep alone runs its
split decode (prefill_partial): the same bits (attention_decode.py SPLIT_DECODE_MIN_CHUNKS).

Tables: each object holds a device table of the slots' buffer addresses for every layer (int64, built once from
the arrays' ``.data.ptr``; the arrays are held), and a small per-pass table uploaded by ``begin`` / ``set_rows`` (one
host-to-device copy each), read by every layer's launch.

References (``reference_attention_slots``, ``reference_gdn_slots``): the loop over slots of
attention_decode.reference_step and gdn_seq.reference_prefill at T = 1; relative error ≤ 1e-5 / 1e-4 as those.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda import attention_decode as ad
from tandem.backend.cuda.attention_args import rotary_args
from tandem.backend.cuda import gdn_seq as gs
from tandem.backend.cuda.arrays import f32, i32, kv_suffix, require, require_kv
from tandem.backend.cuda.loader import cupy, kernel, raise_smem_limit
from tandem.backend.cuda.operand import SPLIT_CODE, split_operand
from tandem.backend.cuda.plan import Relaunch

SLOT_FIELDS = 4  # the per-pass table's columns (cuda/attention_decode.cu SLOT_*): pos, rotary pos, row, first chunk
PARTIALS_SPARE = 64  # chunks of headroom when the partials grow (positions advance a row a step)
NULL = np.uint64(0)


def slot_table(positions: Sequence[int], rope_shifts: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    """The per-pass table of S slots: int32 [S, 4] of (pos, pos + rope_shift, row, first chunk), the first chunks
    the running sum of the slots' chunk counts C_s = pos // 64 + 1 (each slot's partials their own region).

    Raises: ValueError on lengths that differ, a negative position or rotary position, a negative or repeated row.
    """
    s = len(positions)
    if len(rope_shifts) != s or len(rows) != s:
        raise ValueError(f"slots: {s} positions, {len(rope_shifts)} rope shifts, {len(rows)} rows")
    if len(set(rows)) != s or any(r < 0 for r in rows):
        raise ValueError(f"rows: expected distinct rows ≥ 0, got {list(rows)}")
    table = np.zeros((s, SLOT_FIELDS), dtype=np.int32)
    first = 0
    for n, (pos, shift, row) in enumerate(zip(positions, rope_shifts, rows)):
        if pos < 0 or pos + shift < 0:
            raise ValueError(f"slot {n}: position {pos} (rope shift {shift}) is negative")
        table[n] = (pos, pos + shift, row, first)
        first += pos // ad.CHUNK + 1
    return table


def table_chunks(table: np.ndarray) -> tuple[int, int]:
    """(total chunks, most chunks of a slot) of a `slot_table`."""
    chunks = table[:, 0] // ad.CHUNK + 1
    return int(chunks.sum()), int(chunks.max())


def _pointer_table(arrays: Sequence[Sequence[Any]]) -> Any:
    """int64 device array of the arrays' addresses, in the nesting's shape ([L, S] or [L, S, 2])."""
    host = np.asarray([[[a.data.ptr for a in x] if isinstance(x, (list, tuple)) else x.data.ptr for x in row]
                       for row in arrays], dtype=np.int64)
    return cupy().asarray(host)


class AttentionSlots:
    """The decode attention of S slots, one launch a layer (two where a slot's combine runs apart).

    Args:
        k_caches, v_caches: [L][S] device arrays, layer l's K / V cache of slot s: [max_len_s, Hkv, D] float32, or
            all uint16 (bfloat16 bits); Hkv, D and the dtype the same for every slot and layer, max_len_s may differ.
        heads: H query heads (a multiple of Hkv, G = H / Hkv ≤ 8).
        fused: attention_decode_step's ``fused`` (a slot of ≤ FUSED_MAX_CHUNKS chunks combines in its partial
            launch's last block), else every slot's combine is attn_combine_slots; the same bits either way.
    ``begin(positions, rope_shifts, rows)`` uploads a pass's table (once a pass, before the layers' launches);
    ``step(layer, ...)`` builds one layer's launches (a callable, for a launch plan). The caches are held.
    Raises: ValueError on caches of mixed shapes / dtypes, or heads not a multiple of Hkv with G ≤ 8.
    """

    def __init__(self, k_caches: Sequence[Sequence[Any]], v_caches: Sequence[Sequence[Any]], heads: int,
                 fused: bool = False) -> None:
        if not k_caches or not k_caches[0] or len(v_caches) != len(k_caches):
            raise ValueError("k_caches / v_caches: expected [L][S] caches, L and S ≥ 1, as many V as K")
        first = k_caches[0][0]
        require_kv("k_caches[0][0]", first, (None, None, None))
        self.hkv, self.d = int(first.shape[1]), int(first.shape[2])
        self.num_slots = len(k_caches[0])
        for layer, (ks, vs) in enumerate(zip(k_caches, v_caches)):
            if len(ks) != self.num_slots or len(vs) != self.num_slots:
                raise ValueError(f"layer {layer}: {len(ks)} K and {len(vs)} V caches for {self.num_slots} slots")
            for s, (kc, vc) in enumerate(zip(ks, vs)):
                require_kv(f"k_caches[{layer}][{s}]", kc, (None, self.hkv, self.d), like=first)
                require_kv(f"v_caches[{layer}][{s}]", vc, tuple(kc.shape), like=first)
        if heads % self.hkv or heads // self.hkv > ad.MAX_GROUP:
            raise ValueError(f"heads {heads}: a multiple of Hkv {self.hkv} with at most {ad.MAX_GROUP} a KV head")
        self.heads, self.fused = heads, fused
        self.max_lens = [min(int(ks[s].shape[0]) for ks in k_caches) for s in range(self.num_slots)]
        self.suffix, self.smem = kv_suffix(first), ad.partial_smem(first)
        self.keep = (k_caches, v_caches)
        self.kv_table = _pointer_table([[(k, v) for k, v in zip(ks, vs)] for ks, vs in zip(k_caches, v_caches)])
        self.slots = cupy().zeros((self.num_slots, SLOT_FIELDS), dtype=np.int32)
        self.counter = ad.counter(self.num_slots * self.hkv)
        self.parts: tuple[Any, Any, Any] | None = None
        self.table = np.zeros((self.num_slots, SLOT_FIELDS), dtype=np.int32)
        self.max_chunks, self.z, self.combine = 1, 1, True

    def begin(self, positions: Sequence[int], rope_shifts: Sequence[int], rows: Sequence[int]) -> None:
        """A pass's slots: slot s decodes position positions[s] (its row written there, rows 0..pos attended),
        rotated at pos + rope_shifts[s], from row rows[s] of the joint inputs into row rows[s] of the output. One
        host-to-device copy (int32 [S, 4]); the partials grow (a new buffer) when the slots' chunks outgrow them.
        Raises: ValueError as `slot_table`, on S other than the caches', or a position outside a slot's caches."""
        if len(positions) != self.num_slots:
            raise ValueError(f"positions: {len(positions)} for {self.num_slots} slots")
        for s, pos in enumerate(positions):
            if pos >= self.max_lens[s]:
                raise ValueError(f"slot {s}: pos {pos} outside its caches of {self.max_lens[s]} rows")
        table = slot_table(positions, rope_shifts, rows)
        total, self.max_chunks = table_chunks(table)
        if self.parts is None or int(self.parts[0].shape[0]) < total:
            cp, n = cupy(), total + PARTIALS_SPARE
            self.parts = (cp.empty((n, self.heads, self.d), dtype=cp.float32),
                          cp.empty((n, self.heads), dtype=cp.float32), cp.empty((n, self.heads), dtype=cp.float32))
        chunks = table[:, 0] // ad.CHUNK + 1
        self.combine = not self.fused or bool((chunks > ad.FUSED_MAX_CHUNKS).any())
        self.z = ad.head_splits(self.heads // self.hkv, self.hkv * total)
        self.table = table  # held: the copy may still be reading it
        self.slots.set(table)

    def step(self, layer: int, qg: Any, k_new: Any, v_new: Any, q_norm: Any, k_norm: Any, inv_freq: Any, eps: float,
             out: Any = None, *, split: str | None = None, xs: Any = None) -> SlotsStep:
        """Layer `layer`'s launches for the slots of each `begin` (see `SlotsStep`)."""
        return SlotsStep(self, layer, qg, k_new, v_new, q_norm, k_norm, inv_freq, eps, out, split=split, xs=xs)


PARTIAL_NZ, PARTIAL_ACC, COMBINE_ACC = 2, 14, 1  # argument indexes (ATTN_SLOTS_PARAMS, attn_combine_slots)


class SlotsStep:
    """One attention layer of `AttentionSlots` for the slots of its latest ``begin``: ``step()`` launches
    attn_partial_slots and, where a slot's combine runs apart, attn_combine_slots (plan.Relaunch: argument blocks
    built once, the grid and Z set a call).

    Args: owner; layer: its index in owner's caches; qg [R, H, 2D] float32 (q then gate per head), k_new, v_new
    [R, Hkv, D] float32, the joint rows (slot s reads row rows[s]); q_norm, k_norm [D], inv_freq [rd/2] float32;
    eps; out: [R, H·D] float32 (row rows[s] written), or with split ("f16" / "f16p" / "bf16") xs [R, P, H·D]
    uint16 (gemv.prepare's layout and bits), allocated when None. All C-contiguous. ``result``: out or xs.
    Raises: ValueError on bad shapes / dtypes, out with split, xs without it; at a call, a row of the pass ≥ R.
    """

    def __init__(self, owner: AttentionSlots, layer: int, qg: Any, k_new: Any, v_new: Any, q_norm: Any,
                 k_norm: Any, inv_freq: Any, eps: float, out: Any = None, *, split: str | None = None,
                 xs: Any = None) -> None:
        h, hkv, d = owner.heads, owner.hkv, owner.d
        require("qg", qg, np.float32, (None, h, 2 * d))
        rows = int(qg.shape[0])
        require("k_new", k_new, np.float32, (rows, hkv, d))
        require("v_new", v_new, np.float32, (rows, hkv, d))
        rotary_dim = rotary_args(d, q_norm, k_norm, inv_freq)
        if not 0 <= layer < int(owner.kv_table.shape[0]):
            raise ValueError(f"layer {layer} outside the {int(owner.kv_table.shape[0])} layers of the slots")
        if split is None:
            if xs is not None:
                raise ValueError("xs: given without split")
            y = out if out is not None else cupy().empty((rows, h * d), dtype=np.float32)
            require("out", y, np.float32, (rows, h * d))
            kind, row_stride, out_arg, xs_arg = 0, h * d, y, y
        else:
            if out is not None:
                raise ValueError("out: a split call writes xs, not out")
            y = split_operand(split, xs, rows, h * d, name="xs")
            kind, row_stride, out_arg, xs_arg = SPLIT_CODE[split], int(y.strides[0]) // 2, y, y
        self.result, self.owner, self.rows, self.h, self.d = y, owner, rows, h, d
        gate = qg[:, :, d:]
        scale = f32(float(np.float32(1.0 / np.sqrt(d))))
        fused, max_chunks = i32(int(owner.fused)), i32(ad.FUSED_MAX_CHUNKS)
        self.parts = owner.parts
        parts = owner.parts if owner.parts is not None else (qg, qg, qg)  # set before a launch (`_sync_parts`)
        out_stride, xs_stride = i32(row_stride if kind == 0 else 0), i32(row_stride if kind else 0)
        self.partial_args: tuple[Any, ...] = (
            owner.kv_table[layer], owner.slots, i32(1), qg, i32(h * 2 * d), i32(2 * d), k_new, v_new, i32(hkv * d),
            q_norm, k_norm, inv_freq, i32(rotary_dim), f32(eps), parts[0], parts[1], parts[2], i32(h), i32(hkv),
            i32(d), scale, fused, max_chunks, owner.counter, gate, i32(1), i32(2 * d), out_arg, out_stride, i32(kind),
            xs_arg, xs_stride)
        grid, _ = ad.combine_shape(h, d)
        self.combine_grid = (grid[0], grid[1], owner.num_slots)
        self.combine_args: tuple[Any, ...] = (
            owner.slots, parts[0], parts[1], parts[2], gate, i32(1), i32(2 * d), i32(h * 2 * d), out_arg, out_stride,
            i32(h), i32(d), i32(kind), xs_arg, xs_stride, fused, max_chunks)
        self.keep = (qg, k_new, v_new, q_norm, k_norm, inv_freq, y)
        self._partials: dict[str, Relaunch] = {}
        self._combine: Relaunch | None = None

    def _sync_parts(self) -> None:
        """Point every built launch at the owner's current partials (they grow in ``begin``)."""
        parts = self.owner.parts
        if parts is None:
            raise ValueError("AttentionSlots.begin must run before a layer's launch")
        if parts is self.parts:
            return
        self.parts = parts
        a = self.partial_args
        self.partial_args = a[:PARTIAL_ACC] + tuple(parts) + a[PARTIAL_ACC + 3:]
        c = self.combine_args
        self.combine_args = c[:COMBINE_ACC] + tuple(parts) + c[COMBINE_ACC + 3:]
        for launch in self._partials.values():
            for n, p in enumerate(parts):
                launch.set(PARTIAL_ACC + n, int(p.data.ptr))
        if self._combine is not None:
            for n, p in enumerate(parts):
                self._combine.set(COMBINE_ACC + n, int(p.data.ptr))

    def __call__(self) -> None:
        owner = self.owner
        if int(owner.table[:, 2].max()) >= self.rows:
            raise ValueError(f"a slot's row {int(owner.table[:, 2].max())} outside the {self.rows} joint rows")
        self._sync_parts()
        z = owner.z
        name = ad.partial_kernel(owner.heads // owner.hkv // z).replace("attn_partial", "attn_partial_slots")
        name += owner.suffix
        launch = self._partials.get(name)
        if launch is None:
            fn = kernel("attention_decode", name)
            raise_smem_limit(fn, owner.smem)
            launch = self._partials[name] = Relaunch(fn, (owner.hkv, 1, 1), (ad.THREADS,), self.partial_args,
                                                     owner.smem)
        launch.set(PARTIAL_NZ, z)
        launch.launch((owner.hkv, owner.max_chunks, z * owner.num_slots))
        if owner.combine:
            if self._combine is None:
                self._combine = Relaunch(kernel("attention_decode", "attn_combine_slots"), self.combine_grid,
                                         (ad.COMBINE_WIDTH,), self.combine_args)
            self._combine.launch()


class GDNSlots:
    """The GDN decode update of S slots, two launches a layer (gdn_decode_conv_slots, gdn_decode_head_slots<dk>).

    Args:
        tails: [L][S] device arrays, layer l's conv tail of slot s: [K-1, C] float32; states: [L][S], its recurrent
            state [Hv, dk, dv] float32 (dk ∈ gdn_seq.KEY_HEAD_SIZES, dv a multiple of 32, ≤ 1024); the shapes the
            same for every slot and layer. Both updated in place by each step; held.
        rows: slot s's row of the joint rows (distinct, ≥ 0); ``set_rows`` changes them (one copy).
    Raises: ValueError on mixed shapes or dtypes, or bad rows.
    """

    def __init__(self, tails: Sequence[Sequence[Any]], states: Sequence[Sequence[Any]], rows: Sequence[int]) -> None:
        if not tails or not tails[0] or len(states) != len(tails):
            raise ValueError("tails / states: expected [L][S] arrays, L and S ≥ 1, as many states as tails")
        self.num_slots = len(tails[0])
        t0, s0 = tails[0][0], states[0][0]
        require("tails[0][0]", t0, np.float32, (None, None))
        require("states[0][0]", s0, np.float32, (None, None, None))
        for layer, (ts, ss) in enumerate(zip(tails, states)):
            if len(ts) != self.num_slots or len(ss) != self.num_slots:
                raise ValueError(f"layer {layer}: {len(ts)} tails and {len(ss)} states for {self.num_slots} slots")
            for s, (t, st) in enumerate(zip(ts, ss)):
                require(f"tails[{layer}][{s}]", t, np.float32, tuple(t0.shape))
                require(f"states[{layer}][{s}]", st, np.float32, tuple(s0.shape))
        self.taps, self.channels = int(t0.shape[0]) + 1, int(t0.shape[1])
        self.hv, self.dk, self.dv = (int(n) for n in s0.shape)
        self.keep = (tails, states)
        self.tails, self.states = _pointer_table(tails), _pointer_table(states)
        self.rows = cupy().zeros((self.num_slots,), dtype=np.int32)
        self.host_rows = np.zeros((self.num_slots,), dtype=np.int32)
        self.set_rows(rows)

    def set_rows(self, rows: Sequence[int]) -> None:
        """Slot s reads and writes row rows[s] of the joint rows from the next step on (one host-to-device copy).
        Raises: ValueError on a count other than S, a negative or repeated row."""
        if len(rows) != self.num_slots or len(set(rows)) != len(rows) or any(r < 0 for r in rows):
            raise ValueError(f"rows: expected {self.num_slots} distinct rows ≥ 0, got {list(rows)}")
        self.host_rows = np.asarray(rows, dtype=np.int32)
        self.rows.set(self.host_rows)

    def step(self, layer: int, mixed: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any,
             norm_w: Any, num_k_heads: int, eps: float, out: Any = None, *, split: str | None = None, xs: Any = None,
             u: Any = None) -> Any:
        """gdn_seq.gdn_decode of every slot: slot s's row rows[s] of the joint rows, its tail and state.

        Args: layer: its index in the tables; mixed [R, C], a, b [R, Hv], z [R, Hv·dv] float32 (C-contiguous);
        conv_w [C, K], a_log, dt_bias [Hv], norm_w [dv] float32; num_k_heads: Hk; eps; out: optional [R, Hv·dv]
        float32 for y; split / xs as gdn_decode's (xs [R, P, Hv·dv] uint16); u: optional [R, C] float32 scratch.
        Returns: y [R, Hv·dv] float32 (rows rows[s] written), or xs with split.
        Raises: ValueError on bad shapes / dtypes, Hk not dividing Hv, a row ≥ R, an unknown split."""
        c, hv, dk, dv = self.channels, self.hv, self.dk, self.dv
        require("mixed", mixed, np.float32, (None, c))
        r = int(mixed.shape[0])
        if int(self.host_rows.max()) >= r:
            raise ValueError(f"a slot's row {int(self.host_rows.max())} outside the {r} joint rows")
        if num_k_heads < 1 or hv % num_k_heads or c != 2 * num_k_heads * dk + hv * dv:
            raise ValueError(f"num_k_heads {num_k_heads}: must divide Hv {hv} with C {c} = 2·Hk·dk + Hv·dv")
        if not 0 <= layer < int(self.states.shape[0]):
            raise ValueError(f"layer {layer} outside the {int(self.states.shape[0])} layers of the slots")
        require("conv_w", conv_w, np.float32, (c, self.taps))
        gs.check_gates(a, b, a_log, dt_bias, z, norm_w, r, hv, dv)
        cp = cupy()
        u = cp.empty((r, c), dtype=np.float32) if u is None else u
        require("u", u, np.float32, (r, c))
        if split is None:
            if xs is not None:
                raise ValueError("xs: only with a split kind")
            y = cp.empty((r, hv * dv), dtype=np.float32) if out is None else out
            require("out", y, np.float32, (r, hv * dv))
            kind, y_arg, xs_arg, xs_stride = 0, y, NULL, 0
        else:
            y = split_operand(split, xs, r, hv * dv, name="xs")
            kind, y_arg, xs_arg, xs_stride = SPLIT_CODE[split], NULL, y, int(y.strides[0]) // 2
        s = self.num_slots
        kernel("gdn_seq", "gdn_decode_conv_slots")(
            (-(-c // gs.CONV_THREADS), s), (gs.CONV_THREADS,),
            (self.rows, self.tails[layer], mixed, i32(c), conv_w, u, i32(c), i32(c), i32(self.taps)))
        cols = gs._cols(dk)
        kernel("gdn_seq", f"gdn_decode_head_slots{dk}")(
            (hv, s), (32 * min(dv // cols, gs.DECODE_MAX_WARPS),),
            (self.rows, self.states[layer], u, i32(c), a, b, i32(hv), a_log, dt_bias, z, i32(hv * dv), norm_w, y_arg,
             i32(hv * dv), xs_arg, i32(xs_stride), i32(kind), i32(num_k_heads), i32(hv), i32(dv),
             f32(float(np.float32(1.0 / np.sqrt(dk)))), f32(eps)))
        return y


def reference_attention_slots(qg: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, q_norm: np.ndarray,
                              k_norm: np.ndarray, rotary_dim: int, theta: float, k_caches: Sequence[np.ndarray],
                              v_caches: Sequence[np.ndarray], positions: Sequence[int], rope_shifts: Sequence[int],
                              rows: Sequence[int], eps: float) -> np.ndarray:
    """The NumPy twin of `AttentionSlots` (one layer): attention_decode.reference_step of each slot s on row rows[s]
    of qg [R, H, 2D], k_new / v_new [R, Hkv, D] with its caches (written at its position) at positions[s] rotated
    at + rope_shifts[s]. Returns [R, H·D] float32: rows rows[s] the slots' outputs, the others zero."""
    r, h, d2 = qg.shape
    y = np.zeros((r, h * (d2 // 2)), dtype=np.float32)
    for s, row in enumerate(rows):
        y[row] = ad.reference_step(qg[row], k_new[row], v_new[row], q_norm, k_norm, rotary_dim, theta, k_caches[s],
                                   v_caches[s], positions[s], eps, rope_shift=rope_shifts[s])
    return y


def reference_gdn_slots(mixed: np.ndarray, tails: Sequence[np.ndarray], conv_w: np.ndarray, a: np.ndarray,
                        b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, z: np.ndarray, norm_w: np.ndarray,
                        states: Sequence[np.ndarray], num_k_heads: int, eps: float, rows: Sequence[int]) -> np.ndarray:
    """The NumPy twin of `GDNSlots.step`: gdn_seq.reference_prefill of one token for each slot s on row rows[s] of
    mixed [R, C], a / b [R, Hv], z [R, Hv·dv], with its tail and state (updated in place). Returns y [R, Hv·dv]
    float32: rows rows[s] the slots' outputs, the others zero."""
    y = np.zeros(z.shape, dtype=np.float32)
    for s, row in enumerate(rows):
        sl = slice(row, row + 1)
        y[sl] = gs.reference_prefill(mixed[sl], tails[s], conv_w, a[sl], b[sl], a_log, dt_bias, z[sl], norm_w,
                                     states[s], num_k_heads, eps)
    return y
