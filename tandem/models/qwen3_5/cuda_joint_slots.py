"""The joint pass's batched decode launches (``CudaJointRounds.JOINT_BATCHED``): every decode row's attention in one
launch a layer (two where a combine runs apart) and its GDN update in two, over a device table of the slots' state
buffers (tandem/backend/cuda/decode_slots.py), instead of a launcher call a slot.

A ``SlotKernels`` is built once per set of decode states (the tables hold their buffers' addresses); a pass then
uploads its positions, rotary shifts and rows (``begin``: one small copy for attention, one for the GDN rows) and
each layer launches for all slots. Each slot's blocks run the kernels of its own decode with its own pointers, so a
slot's logits and state keep the bits of that slot decoded alone (decode_slots.py, "Exactness").

The tensor-core attention (``DECODE_ATTENTION = "tensor_cores"``) keeps the per-slot loop (``attn`` is None there);
the GDN update is batched either way. Verify trees keep their per-part launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.backend.cuda.decode_slots import AttentionSlots, GDNSlots
from tandem.models.qwen3_5.cuda_layers import _GDN, _Attn

MAX_SLOT_KERNELS = 8  # sets of states whose tables the unplanned passes keep (least recently used dropped)


class SlotKernels:
    """The batched decode launches of one set of states (a pass's decode rows, in order).

    Args: layers: the model's layers (``_Layer``: mixer _Attn or _GDN); states: the slots' DeviceStates; heads: H;
    fused: attention_decode_step's ``fused`` (cuda_layer_ops.ATTN_FUSED); attention: batch the attention (False:
    the tensor-core path, which keeps its per-slot loop). Holds the states' buffers.
    Raises: ValueError where the states' buffers differ in shape or dtype (decode_slots)."""

    def __init__(self, layers: Sequence[Any], states: Sequence[Any], heads: int, fused: bool,
                 attention: bool = True) -> None:
        self.states = list(states)
        attn = [i for i, lw in enumerate(layers) if isinstance(lw.mixer, _Attn)]
        gdn = [i for i, lw in enumerate(layers) if isinstance(lw.mixer, _GDN)]
        self.attn_index = {i: n for n, i in enumerate(attn)}
        self.gdn_index = {i: n for n, i in enumerate(gdn)}
        self.attn: AttentionSlots | None = None
        if attention and attn:
            self.attn = AttentionSlots([[s.buffers[f"layers.{i}.k"] for s in states] for i in attn],
                                       [[s.buffers[f"layers.{i}.v"] for s in states] for i in attn], heads, fused)
        self.gdn: GDNSlots | None = None
        if gdn:
            self.gdn = GDNSlots([[s.buffers[f"layers.{i}.conv"] for s in states] for i in gdn],
                                [[s.buffers[f"layers.{i}.ssm"] for s in states] for i in gdn], range(len(states)))

    def holds(self, states: Sequence[Any]) -> bool:
        """Whether these are the tables of exactly `states` (the same objects, in order)."""
        return len(states) == len(self.states) and all(a is b for a, b in zip(states, self.states))

    def begin(self, positions: Sequence[int], rope_shifts: Sequence[int], rows: Sequence[int]) -> None:
        """A pass: slot s decodes at positions[s] (rotated at + rope_shifts[s]) on joint row rows[s]."""
        if self.attn is not None:
            self.attn.begin(positions, rope_shifts, rows)
        if self.gdn is not None and list(self.gdn.host_rows) != list(rows):
            self.gdn.set_rows(rows)

    def attention(self, i: int, w: _Attn, qg: Any, k: Any, v: Any, inv_freq: Any, eps: float, kind: str | None,
                  y: Any, run: bool = True) -> Any:
        """Attention layer i's launches for the pass's slots (writing their rows of y: [R, H·D] float32, or with
        kind the split operand [R, P, H·D] uint16); returns the step (a callable), run once unless ``run`` is
        False (a launch plan's ``add_call`` runs it)."""
        assert self.attn is not None
        step = self.attn.step(self.attn_index[i], qg, k, v, w.q_norm, w.k_norm, inv_freq, eps,
                              out=None if kind is not None else y, split=kind, xs=y if kind is not None else None)
        if run:
            step()
        return step

    def gdn_layer(self, i: int, w: _GDN, mixed: Any, z: Any, a: Any, b: Any, num_k_heads: int, eps: float,
                  kind: str | None, y: Any) -> None:
        """GDN layer i's update for the pass's slots (their rows of y, or of the split operand with kind)."""
        assert self.gdn is not None
        self.gdn.step(self.gdn_index[i], mixed, w.conv, a, b, w.a_log, w.dt_bias, z, w.norm, num_k_heads, eps,
                      out=None if kind is not None else y, split=kind, xs=y if kind is not None else None)


def slot_kernels(cache: dict[tuple[int, ...], SlotKernels], layers: Sequence[Any], states: Sequence[Any],
                 heads: int, fused: bool, attention: bool) -> SlotKernels:
    """The cached SlotKernels of `states` (built on first use; at most MAX_SLOT_KERNELS kept, least recently used
    dropped)."""
    key = tuple(id(s) for s in states)
    found = cache.pop(key, None)
    if found is not None and found.holds(states) and (found.attn is not None) == attention:
        cache[key] = found
        return found
    while len(cache) >= MAX_SLOT_KERNELS:
        cache.pop(next(iter(cache)))
    made = cache[key] = SlotKernels(layers, states, heads, fused, attention)
    return made
