"""Fused MoE experts as quantisable modules (spec/qwen3_5.md §2.3).

BF16 MoE releases store each layer's routed experts fused: ``{p}experts.gate_up_proj`` [E, 2I, D] (per expert
I gate rows then I up rows) and ``{p}experts.down_proj`` [E, D, I]. Quantised releases store them per expert
(``{p}experts.{e}.{gate,up,down}_proj.*``), and so does the quantiser: each fused tensor is seen as E (or 2E)
virtual modules ``{p}experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, and a layer whose experts are
quantised is written per expert (experts left out keep their stored bits as a per-expert ``.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.dtypes import bf16_to_f32, f16_to_f32
from tandem.safetensors_io import Tensor

_GATE_UP, _DOWN = "experts.gate_up_proj", "experts.down_proj"


@dataclass(frozen=True)
class ExpertSlice:
    """One virtual module: rows [row0, row1) of expert ``expert`` in the fused ``tensor``."""

    tensor: str
    expert: int
    row0: int
    row1: int


def fused_expert_modules(ckpt: Checkpoint) -> dict[str, ExpertSlice]:
    """Virtual module name -> its slice, for every fused 3-D expert tensor of the text model, checkpoint order."""
    out: dict[str, ExpertSlice] = {}
    for name in ckpt.text_names():
        shape = ckpt.shape(name)
        if len(shape) != 3:
            continue
        if name.endswith("." + _GATE_UP):
            p, half = name[:-len("gate_up_proj")], shape[1] // 2
            for e in range(shape[0]):
                out[f"{p}{e}.gate_proj"] = ExpertSlice(name, e, 0, half)
                out[f"{p}{e}.up_proj"] = ExpertSlice(name, e, half, shape[1])
        elif name.endswith("." + _DOWN):
            p = name[:-len("down_proj")]
            for e in range(shape[0]):
                out[f"{p}{e}.down_proj"] = ExpertSlice(name, e, 0, shape[1])
    return out


def slice_bits(ckpt: Checkpoint, s: ExpertSlice) -> Tensor:
    """The stored bits of a slice: (safetensors dtype, [row1 - row0, in] array)."""
    return ckpt.dtype(s.tensor), np.array(ckpt.raw(s.tensor)[s.expert, s.row0:s.row1])


def slice_f32(ckpt: Checkpoint, s: ExpertSlice) -> npt.NDArray[np.float32]:
    """A slice decoded exactly to float32. Raises CheckpointError for a dtype other than BF16/F16/F32."""
    dtype, bits = slice_bits(ckpt, s)
    if dtype == "BF16":
        return bf16_to_f32(bits.astype(np.uint16, copy=False))
    if dtype == "F16":
        return f16_to_f32(bits.astype(np.uint16, copy=False))
    if dtype == "F32":
        return np.ascontiguousarray(bits, dtype=np.float32)
    raise CheckpointError(f"{s.tensor}: fused experts must be BF16, F16 or F32, found {dtype}")
