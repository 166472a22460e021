"""Lazy, exact reading of safetensors checkpoints (single file or sharded with an index).

We parse safetensors headers ourselves (8-byte little-endian header length, then a JSON header mapping each
tensor name to dtype, shape and byte offsets relative to the end of the header) and map the data with
numpy.memmap. safetensors' own NumPy API cannot return BF16 or F8_E4M3 tensors (NumPy has no such dtypes), so
it is not used here.

Layout facts (spec/qwen3_5.md §2.1): the text model lives under `model.language_model.` in the VLM release
layout, or under `model.` in flat exports (Qwen3-Next, text-only); `model.visual.*` is the vision tower and
`mtp.*` the MTP head, both skipped by name by the language loader.
"""

from __future__ import annotations

import difflib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tandem.dtypes import bf16_to_f32, e4m3_to_f32, f16_to_f32

# safetensors dtype string -> (numpy dtype of the stored bits, bytes per element)
_STORAGE: dict[str, np.dtype[np.generic]] = {
    "BF16": np.dtype(np.uint16),
    "F16": np.dtype(np.uint16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(np.uint8),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
_DECODABLE = ("BF16", "F16", "F32", "F8_E4M3")
_INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed, or lacks / mis-shapes a requested tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype string, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check every tensor's byte range lies inside the file.

    Raises:
        CheckpointError: missing/unreadable file, header length or JSON invalid, offsets past end of file
            (truncated file), or a byte range that does not match shape × element size.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file not found")
    file_bytes = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: file too short for a safetensors header ({file_bytes} bytes)")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(file_bytes - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{path}: header length {header_bytes} exceeds the file ({file_bytes} bytes); truncated?")
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + header_bytes
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(entry["dtype"])
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}") from e
        if not 0 <= begin <= end or data_start + end > file_bytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans bytes [{begin}, {end}) of the data section, past the end of "
                f"the file ({file_bytes - data_start} data bytes); the file is truncated or corrupt")
        storage = _STORAGE.get(dtype)
        if storage is not None and end - begin != math.prod(shape) * storage.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype}, shape {list(shape)}) has {end - begin} bytes, "
                f"expected {math.prod(shape) * storage.itemsize}")
        infos[name] = TensorInfo(path, dtype, shape, data_start + begin, data_start + end)
    return infos


class Checkpoint:
    """Read-only view of a safetensors checkpoint; tensors are memory-mapped and decoded on request.

    Open with :meth:`Checkpoint.open`. Names are the checkpoint's own (e.g.
    `model.language_model.layers.0.linear_attn.A_log`). Source: spec/qwen3_5.md §2.
    """

    def __init__(self, root: Path, tensors: dict[str, TensorInfo]) -> None:
        self.root = root
        self._tensors = tensors
        self._maps: dict[Path, np.memmap[tuple[int], np.dtype[np.uint8]]] = {}
        if any(n.startswith("model.language_model.") for n in tensors):
            self.language_model_prefix = "model.language_model."
        else:
            self.language_model_prefix = "model."

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open a directory holding `model.safetensors` or `model.safetensors.index.json` + shards, or one file.

        Raises:
            CheckpointError: the path does not exist; the directory has neither file; the index is not valid
                JSON or names a shard that does not exist; a shard is truncated or has a bad header; the same
                tensor appears in two shards.
        """
        root = Path(path)
        if not root.exists():
            raise CheckpointError(f"{root}: checkpoint path does not exist")
        if root.is_file():
            return cls(root.parent, _read_header(root))
        index = root / _INDEX_NAME
        if index.is_file():
            return cls(root, _read_index(index))
        single = root / _SINGLE_NAME
        if single.is_file():
            return cls(root, _read_header(single))
        raise CheckpointError(f"{root}: neither {_SINGLE_NAME} nor {_INDEX_NAME} found")

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._tensors)

    def text_names(self) -> list[str]:
        """Tensor names of the language model and head: all names except `model.visual.*` and `mtp.*`."""
        return [n for n in self.names() if not n.startswith(("model.visual.", "mtp."))]

    def mtp_names(self) -> list[str]:
        """Tensor names of the MTP head (`mtp.*`, spec §2.4), sorted."""
        return [n for n in self.names() if n.startswith("mtp.")]

    def has(self, name: str) -> bool:
        """Whether tensor `name` is stored."""
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        """File, dtype, shape and byte range of `name`. Raises CheckpointError (with close names) if absent."""
        found = self._tensors.get(name)
        if found is None:
            close = difflib.get_close_matches(name, self._tensors.keys(), n=5, cutoff=0.6)
            hint = f"; close names: {close}" if close else ""
            raise CheckpointError(f"{self.root}: tensor {name!r} not found in checkpoint{hint}")
        return found

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of `name`. Raises CheckpointError if absent."""
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        """Stored safetensors dtype string of `name` (BF16, F16, F32, F8_E4M3, U8, ...)."""
        return self.info(name).dtype

    def raw(self, name: str) -> npt.NDArray[np.generic]:
        """The stored bits of `name`, memory-mapped, read-only, in the stored shape.

        Returns uint16 for BF16/F16, uint8 for F8_E4M3/U8, float32 for F32 (other integer dtypes as themselves).
        Raises:
            CheckpointError: tensor absent, or its dtype is not one we know (names dtype and tensor).
        """
        info = self.info(name)
        storage = _STORAGE.get(info.dtype)
        if storage is None:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has unknown dtype {info.dtype!r} (known: {sorted(_STORAGE)})")
        if info.begin == info.end:
            return np.zeros(info.shape, dtype=storage)
        data = self._map(info.file)[info.begin:info.end]
        return data.view(storage).reshape(info.shape)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> npt.NDArray[np.float32]:
        """`name` decoded exactly to a new float32 array; `shape`, if given, must equal the stored shape.

        Raises:
            CheckpointError: tensor absent; stored shape differs from `shape` (names tensor, expected and
                found); dtype not decodable to float32 exactly (only BF16, F16, F32, F8_E4M3 are); a NaN or inf
                value (names the tensor and the count).
        """
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        if info.dtype not in _DECODABLE:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has dtype {info.dtype!r}, which does not decode to float32 "
                f"exactly (decodable: {list(_DECODABLE)})")
        bits = self.raw(name)
        if info.dtype == "BF16":
            out = bf16_to_f32(bits.astype(np.uint16, copy=False))
        elif info.dtype == "F16":
            out = f16_to_f32(bits.astype(np.uint16, copy=False))
        elif info.dtype == "F8_E4M3":
            out = e4m3_to_f32(bits.astype(np.uint8, copy=False))
        else:
            out = np.array(bits, dtype=np.float32, copy=True)
        if not np.isfinite(out).all():  # one pass over what was just decoded: a broken export fails here, not as '!!!!'
            bad = int(np.count_nonzero(~np.isfinite(out)))
            raise CheckpointError(f"{info.file}: tensor {name!r} holds {bad} non-finite value(s) (NaN or inf) of "
                                  f"{out.size}")
        return out

    def _map(self, file: Path) -> np.memmap[tuple[int], np.dtype[np.uint8]]:
        mapped = self._maps.get(file)
        if mapped is None:
            mapped = np.memmap(file, dtype=np.uint8, mode="r")
            self._maps[file] = mapped
        return mapped


def _read_index(index: Path) -> dict[str, TensorInfo]:
    """Read `model.safetensors.index.json` and the headers of every shard it names.

    Raises:
        CheckpointError: index not valid JSON / lacks `weight_map`; a named shard is missing; a tensor the
            index names is not in its shard; a tensor appears in two shards.
    """
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index (need JSON with 'weight_map'): {e}") from e
    tensors: dict[str, TensorInfo] = {}
    for shard_name in sorted(set(weight_map.values())):
        shard = index.parent / shard_name
        if not shard.is_file():
            raise CheckpointError(f"{index}: names shard {shard_name!r}, which does not exist at {shard}")
        for name, info in _read_header(shard).items():
            if name in tensors:
                raise CheckpointError(f"{shard}: tensor {name!r} also stored in {tensors[name].file}")
            tensors[name] = info
    for name, shard_name in weight_map.items():
        if name not in tensors or tensors[name].file.name != shard_name:
            raise CheckpointError(f"{index}: maps tensor {name!r} to {shard_name!r}, which does not hold it")
    return tensors
