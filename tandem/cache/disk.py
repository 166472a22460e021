"""The disk tier's files: one block per file, written atomically, checked on every read.

Layout of a file: ``MAGIC`` (8 bytes) | header length (8 bytes, little-endian) | header (JSON) | payload.
The header holds the cache signature (weights, tokenizer, state layout: tandem/cache/signature.py), the salt, the
sequence's ids 0..end-1, the block's [start, end), its flags, each array's (name, dtype, shape, offset, nbytes) in
the payload, the payload's length and its CRC-32. A file is written to a temporary name in the same folder (mode
0600) and renamed into place, so a reader sees a whole file or none; a folder the tier creates has mode 0700.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson

MAGIC = b"TNDMBLK1"
SUFFIX = ".tblk"
PART_SUFFIX = ".tblk.part"
_LEN = struct.Struct("<Q")
MAX_HEADER_BYTES = 64 << 20


class CacheFileError(Exception):
    """A cache file that is truncated, corrupt, unreadable or from another model / layout."""


def block_name(salt: str, ids: list[int]) -> str:
    """The file name of the block ending the sequence ``ids`` under ``salt`` (a SHA-256 of both)."""
    h = hashlib.sha256(salt.encode())
    h.update(b"\0")
    h.update(np.asarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()[:40] + SUFFIX


def open_dir(path: str | os.PathLike[str]) -> Path:
    """The cache folder, created with mode 0700 when missing (an existing folder keeps its mode).

    Raises: OSError when it cannot be created or is not a folder.
    """
    root = Path(path)
    if not root.exists():
        root.mkdir(parents=True, mode=0o700)
        os.chmod(root, 0o700)
    if not root.is_dir():
        raise NotADirectoryError(f"--cache-dir {root} is not a folder")
    return root


def write_block(root: Path, name: str, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> int:
    """Write ``arrays`` (host, C-contiguous after ``np.ascontiguousarray``) with ``header`` to root/name
    atomically; returns the file's size in bytes. Raises OSError (the temporary file is removed)."""
    meta = []
    parts = []
    offset = 0
    crc = 0
    for key, arr in arrays.items():
        buf = np.ascontiguousarray(arr)
        raw = buf.reshape(-1).view(np.uint8).data
        meta.append([key, buf.dtype.str, list(buf.shape), offset, int(buf.nbytes)])
        crc = zlib.crc32(raw, crc)
        parts.append(raw)
        offset += int(buf.nbytes)
    head = orjson.dumps({**header, "arrays": meta, "payload_bytes": offset, "crc32": crc})
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".", suffix=PART_SUFFIX)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(head)) + head)
            for raw in parts:
                f.write(raw)
        os.replace(tmp, root / name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(MAGIC) + _LEN.size + len(head) + offset


def read_header(path: Path, signature: str) -> dict[str, Any]:
    """The header of a cache file, checked: magic, JSON, signature, and the file's size.

    Raises: CacheFileError (says why).
    """
    try:
        with open(path, "rb") as f:
            lead = f.read(len(MAGIC) + _LEN.size)
            if len(lead) < len(MAGIC) + _LEN.size or lead[:len(MAGIC)] != MAGIC:
                raise CacheFileError("not a Tandem cache file (bad magic)")
            (n,) = _LEN.unpack(lead[len(MAGIC):])
            if n > MAX_HEADER_BYTES:
                raise CacheFileError("header too large")
            head = orjson.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise CacheFileError(f"unreadable: {exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise CacheFileError("corrupt header") from exc
    if not isinstance(head, dict) or head.get("signature") != signature:
        raise CacheFileError("written for another model, tokenizer or state layout")
    if size != len(MAGIC) + _LEN.size + n + int(head.get("payload_bytes", -1)):
        raise CacheFileError("truncated or padded")
    head["header_bytes"] = len(MAGIC) + _LEN.size + n
    head["file_bytes"] = size
    return head


def read_block(path: Path, signature: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and arrays of a cache file, its CRC checked (arrays are read-only views of one buffer).

    Raises: CacheFileError.
    """
    head = read_header(path, signature)
    try:
        with open(path, "rb") as f:
            f.seek(int(head["header_bytes"]))
            payload = f.read(int(head["payload_bytes"]))
    except OSError as exc:
        raise CacheFileError(f"unreadable: {exc}") from exc
    if len(payload) != int(head["payload_bytes"]) or zlib.crc32(payload) != int(head["crc32"]):
        raise CacheFileError("corrupt payload (CRC mismatch)")
    arrays: dict[str, np.ndarray] = {}
    try:
        for key, dtype, shape, offset, nbytes in head["arrays"]:
            arr = np.frombuffer(payload, dtype=np.dtype(dtype), count=int(np.prod(shape)) if shape else 1,
                                offset=int(offset))
            if int(arr.nbytes) != int(nbytes):
                raise CacheFileError("array sizes disagree with the header")
            arrays[str(key)] = arr.reshape(shape)
    except (ValueError, TypeError) as exc:
        raise CacheFileError(f"bad array table: {exc}") from exc
    return head, arrays


def remove(path: Path) -> None:
    """Delete a cache file, ignoring one that is already gone."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
