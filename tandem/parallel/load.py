"""A tensor-parallel mesh from a checkpoint, by the layout its adapter declares (``tensor_parallel_layout``).

"qwen3_5": the dense Qwen3.5 split of plan.py, on the CPU as ``NumpyMeshModel`` (simulated ranks), on GPUs as
``CudaMeshModel``. The engine calls ``load_mesh``; the adapters only name their layout, so the model code does not
import the mesh built over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

LAYOUTS = ("qwen3_5",)


def load_mesh(layout: str, path: str | Path, n: int, device: str, devices: Sequence[int] | None = None) -> Any:
    """The checkpoint at ``path`` split over ``n`` ranks in ``layout``, each rank reading only its slices: on
    "cpu" n simulated ranks, on "cuda" GPUs ``devices`` (default 0..n-1; one GPU repeated: every rank on it).

    Raises: ValueError (an unknown layout or device, a device list of another length than n, fewer GPUs than it
    names), ConfigError (a dimension n does not divide, naming it), CheckpointError (bad tensors, a slice off its
    format's block grid), DeviceLimitError (a rank dimension the CUDA kernels cannot serve)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tensor-parallel layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if device == "cpu":
        from tandem.parallel.numpy_mesh import NumpyMeshModel

        return NumpyMeshModel.load(path, n)
    if device == "cuda":
        from tandem.parallel.cuda_mesh import CudaMeshModel

        devs = list(devices) if devices is not None else list(range(n))
        if len(devs) != n:
            raise ValueError(f"tensor parallel size {n} takes {n} devices, got {devs}")
        return CudaMeshModel.load(path, devs)
    raise ValueError(f"unknown device {device!r} (expected 'cpu' or 'cuda')")
