"""Writing safetensors files in plain NumPy (safetensors' NumPy API cannot record BF16 or F8_E4M3).

The same byte layout `tandem.checkpoint` reads: 8-byte little-endian header length, a JSON header (space-padded
to a multiple of 8 bytes) mapping each name to dtype, shape and data offsets, then the data. A copy of the writer
in tools/make_checkpoint.py, here so the package never imports from tools/.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Tensor = tuple[str, npt.NDArray[Any]]  # (safetensors dtype string, stored bits, e.g. uint16 for BF16)


def save_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file.

    Args:
        path: the file to write.
        tensors: name -> (dtype string, array of the stored bits), written in the dict's order.
        metadata: the header's `__metadata__` (default {"format": "pt"}).
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (dtype, arr) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def write_checkpoint_files(out: Path, tensors: dict[str, Tensor], max_shard_bytes: int = 2 << 30) -> list[Path]:
    """Write `model.safetensors`, or `model-0000i-of-0000N.safetensors` shards + index when over one shard.

    Args:
        out: an existing directory.
        tensors: name -> (dtype string, stored bits).
        max_shard_bytes: a shard closes before the tensor that would take it past this size.
    Returns:
        the files written (shards, then the index if any).
    """
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t[1].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t[1].nbytes
    if len(shards) == 1:
        save_safetensors(out / "model.safetensors", shards[0])
        return [out / "model.safetensors"]
    files, weight_map = [], {}
    for i, part in enumerate(shards):
        file = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(file, part)
        weight_map.update({n: file.name for n in part})
        files.append(file)
    total = sum(t[1].nbytes for t in tensors.values())
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [*files, index]
