"""One tensor-parallel rank's view of a checkpoint: the tensors a ShardPlan splits read as the rank's slice.

The view is a ``Checkpoint`` (same names, dtypes and checks), so the format loaders (tandem/formats/load.py:
BF16, FP8 block-scaled, FP8 per-row / per-tensor, NVFP4) build the rank's Linear from its slice unchanged. Slices
are cut from the memory-mapped file: a row slice is a view of the mapping, a column slice copies the rank's
columns only, so no rank holds a full copy of a split tensor in host memory. A linear's scales follow its codes:
per-row scales by rows, NVFP4's 16-element block scales and FP8's 128 × 128 block scales by their blocks (a slice
must start and end on the block grid), per-tensor scales whole. Source: spec/qwen3_5.md §9-§10 (scale layouts).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from tandem.checkpoint import Checkpoint, CheckpointError, TensorInfo
from tandem.parallel.plan import Range, ShardPlan

_BLOCKS = {"weight_scale": 16, "weight_scale_inv": 128}  # a block scale's elements along a split axis


class ShardedCheckpoint(Checkpoint):
    """``base`` as rank ``rank`` of ``plan`` sees it.

    Raises (from ``info`` / ``raw`` / ``get``): CheckpointError when a split tensor's slice does not fall on its
    format's block grid (naming the tensor, the rank's interval and the block), besides ``Checkpoint``'s own.
    """

    def __init__(self, base: Checkpoint, plan: ShardPlan, rank: int) -> None:
        if not 0 <= rank < plan.n:
            raise ValueError(f"rank {rank} is outside the plan's {plan.n} ranks")
        super().__init__(base.root, base._tensors)
        self.language_model_prefix = base.language_model_prefix
        self._base, self.plan, self.rank = base, plan, rank

    def info(self, name: str) -> TensorInfo:
        """The tensor's entry with the rank's shape (the stored byte range stays the whole tensor's)."""
        info = self._base.info(name)
        cut = self._cut(name, info.shape)
        if cut is None:
            return info
        axis, ranges = cut
        shape = list(info.shape)
        shape[axis] = sum(b - a for a, b in ranges)
        return dataclasses.replace(info, shape=tuple(shape))

    def raw(self, name: str) -> npt.NDArray[np.generic]:
        """The rank's slice of the stored bits (a view of the mapping for a row slice, else a copy of the slice)."""
        full = self._base.raw(name)
        cut = self._cut(name, tuple(full.shape))
        if cut is None:
            return full
        axis, ranges = cut
        parts = [full[a:b] if axis == 0 else full[:, a:b] for a, b in ranges]
        if len(parts) == 1 and axis == 0:
            return parts[0]
        return np.ascontiguousarray(np.concatenate(parts, axis=axis))

    def _cut(self, name: str, shape: tuple[int, ...]) -> tuple[int, list[Range]] | None:
        """(tensor axis, the rank's intervals in stored elements) of ``name``, or None when it is whole."""
        split = self.plan.split(name)
        if split is None or len(shape) <= split.axis:
            return None
        stored = shape[split.axis]
        tensor = name.rsplit(".", 1)[-1]
        if stored == split.size:
            block = 1
        elif stored * 2 == split.size and split.axis == 1:
            block = 2  # NVFP4 codes: two 4-bit values a byte along the input dim
        elif tensor in _BLOCKS and stored == -(-split.size // _BLOCKS[tensor]):
            block = _BLOCKS[tensor]
        elif stored == 1:
            return None  # one scale for the whole axis (per-tensor, or per row when the columns are split)
        else:
            raise CheckpointError(f"{name}: {stored} stored elements along axis {split.axis} do not map onto its "
                                  f"{split.size} features; tensor parallelism cannot split it")
        out = []
        for a, b in split.ranges[self.rank]:
            if a % block or (b % block and b != split.size):
                raise CheckpointError(
                    f"{name}: rank {self.rank}'s features [{a}, {b}) of axis {split.axis} are not on the "
                    f"{block}-element block grid of its format; tensor parallel size {self.plan.n} cannot split "
                    f"this checkpoint here")
            out.append((a // block, -(-b // block)))
        return split.axis, out
