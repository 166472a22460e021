"""The disk tier's files: one block per file, written atomically, checked on every read.

Layout of a file: ``MAGIC`` (8 bytes) | header length (8 bytes, little-endian) | header (JSON) | payload.
The header holds the cache signature (weights, tokenizer, state layout: tandem/cache/signature.py), the salt, the
sequence's ids 0..end-1, the block's [start, end), its flags, each array's (name, dtype, shape, offset, nbytes) in
the payload, the payload's length and its CRC-32. A file is written to a temporary name in the same folder (mode
0600) and renamed into place, so a reader sees a whole file or none; a folder the tier creates has mode 0700.

``BlockReader`` reads a restore's files ahead on threads: one thread reads each file's payload into one of a fixed
ring of reusable host buffers, a second checks its CRC piece by piece as the pieces arrive, and the caller takes
the checked blocks in order while the next ones are read, handing each buffer back once it has copied it out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson

MAGIC = b"TNDMBLK1"
SUFFIX = ".tblk"
PART_SUFFIX = ".tblk.part"
_LEN = struct.Struct("<Q")
MAX_HEADER_BYTES = 64 << 20
log = logging.getLogger("tandem.cache")


class CacheFileError(Exception):
    """A cache file that is truncated, corrupt, unreadable or from another model / layout."""


class ReadAborted(Exception):
    """A ``BlockReader`` that stopped for a reason of its own (closed, no host memory for a buffer), not a file's."""


def block_name(salt: str, ids: list[int]) -> str:
    """The file name of the block ending the sequence ``ids`` under ``salt`` (a SHA-256 of both)."""
    h = hashlib.sha256(salt.encode())
    h.update(b"\0")
    h.update(np.asarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()[:40] + SUFFIX


def open_dir(path: str | os.PathLike[str]) -> Path:
    """The cache folder, created with mode 0700 when missing (an existing folder keeps its mode), and checked
    writable by creating and removing a temporary file in it.

    Raises: ValueError ("--cache-dir PATH: why") when it cannot be created, is not a folder or takes no new file.
    """
    root = Path(path)
    try:
        if not root.exists():
            root.mkdir(parents=True, mode=0o700)
            os.chmod(root, 0o700)
        if not root.is_dir():
            raise ValueError(f"--cache-dir {root}: not a folder")
        fd, probe = tempfile.mkstemp(dir=root, suffix=PART_SUFFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"--cache-dir {root}: {exc.strerror or exc} (a writable folder is needed)") from exc
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


def _header_of(f: BinaryIO, signature: str) -> dict[str, Any]:
    """The checked header of the open file ``f`` (left at the payload's first byte). Raises CacheFileError."""
    try:
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
    try:
        payload = int(head.get("payload_bytes", -1))
    except (TypeError, ValueError) as exc:
        raise CacheFileError("corrupt header") from exc
    if size != len(MAGIC) + _LEN.size + n + payload:
        raise CacheFileError("truncated or padded")
    head["header_bytes"] = len(MAGIC) + _LEN.size + n
    head["file_bytes"] = size
    return head


def read_header(path: Path, signature: str) -> dict[str, Any]:
    """The header of a cache file, checked: magic, JSON, signature, and the file's size.

    Raises: CacheFileError (says why).
    """
    try:
        with open(path, "rb") as f:
            return _header_of(f, signature)
    except OSError as exc:
        raise CacheFileError(f"unreadable: {exc}") from exc


def _arrays_of(head: dict[str, Any], payload: Any) -> dict[str, np.ndarray]:
    """The arrays of a checked payload (a bytes-like object of head["payload_bytes"] bytes), as views of it."""
    arrays: dict[str, np.ndarray] = {}
    try:
        for key, dtype, shape, offset, nbytes in head["arrays"]:
            arr = np.frombuffer(payload, dtype=np.dtype(dtype), count=int(np.prod(shape)) if shape else 1,
                                offset=int(offset))
            if int(arr.nbytes) != int(nbytes):
                raise CacheFileError("array sizes disagree with the header")
            arrays[str(key)] = arr.reshape(shape)
    except (ValueError, TypeError, KeyError) as exc:
        raise CacheFileError(f"bad array table: {exc}") from exc
    return arrays


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
    return head, _arrays_of(head, payload)


def remove(path: Path) -> None:
    """Delete a cache file, ignoring one that is already gone; one that cannot be deleted (a folder of that
    name, a folder no longer writable) is left with a warning: the tier goes on without it."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cache: could not remove %s: %s", path, exc)


PIECE_BYTES = 16 << 20  # a read's size, and the CRC's step behind it


class BlockReader:
    """Reads cache files ahead, in the order given, into a fixed ring of reusable host buffers.

    Args:
        paths: the files, in the order ``take`` returns them. signature: the one every header must carry.
        alloc: a new host buffer, uint8 [n] (pinned memory for a device state); called by the reading thread at
            most once a buffer (again for a buffer too small for a later file). buffer_bytes: the size to allocate
            at least (the largest payload expected). num_buffers: the ring's size (>= 2).
    Memory: at most ``num_buffers`` buffers, each the largest payload read. Threads: a reader (the header's checks,
    then the payload, PIECE_BYTES a read) and a checker (the CRC, a piece as soon as it is read): the read of
    one file, the check of the one before and the caller's copies of the one before that overlap.
    Attributes: read_bytes: bytes read from the files so far.
    """

    def __init__(self, paths: list[Path], signature: str, alloc: Callable[[int], np.ndarray],
                 buffer_bytes: int = 0, num_buffers: int = 3) -> None:
        self._paths = list(paths)
        self._signature = signature
        self._alloc = alloc
        self._buffer_bytes = int(buffer_bytes)
        self._bufs: list[np.ndarray | None] = [None] * max(2, num_buffers)
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(len(self._bufs)):
            self._free.put(slot)
        self._pieces: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._ready: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._stop = threading.Event()
        self._aborted = ""  # why the reading thread gave up, when it did
        self.read_bytes = 0
        self._threads = [threading.Thread(target=self._read, daemon=True, name="tandem-cache-read"),
                         threading.Thread(target=self._check, daemon=True, name="tandem-cache-check")]
        for t in self._threads:
            t.start()

    def take(self) -> tuple[dict[str, Any], dict[str, np.ndarray], int]:
        """The next file's (header, arrays, buffer slot) once its CRC matched: the arrays are views of the slot's
        buffer, valid until ``release(slot)``.

        Raises: CacheFileError: that file is bad (its slot is already released). ReadAborted: the reader was
        closed or could not allocate a buffer (the file is not known to be bad).
        """
        item = None if self._stop.is_set() else self._ready.get()
        if item is None:
            raise ReadAborted(self._aborted or "the reader was closed")
        head, arrays, slot, exc = item
        if exc is not None:
            self.release(slot)
            raise exc
        return head, arrays, slot

    def release(self, slot: int) -> None:
        """Hand a buffer back to the reader (its contents are overwritten by a later file)."""
        self._free.put(slot)

    def close(self) -> None:
        """Stop reading (files not yet read stay unread) and wait for both threads; the buffers are let go."""
        self._stop.set()
        for slot in range(len(self._bufs)):
            self._free.put(slot)  # wakes a reader waiting for a buffer
        for t in self._threads:
            t.join()
        self._bufs = [None] * len(self._bufs)

    def _buffer(self, slot: int, nbytes: int) -> np.ndarray:
        buf = self._bufs[slot]
        if buf is None or buf.nbytes < nbytes:
            self._bufs[slot] = None
            buf = self._bufs[slot] = self._alloc(max(nbytes, self._buffer_bytes, 1))
        return buf

    def _read(self) -> None:
        try:
            for path in self._paths:
                slot = self._free.get()
                if self._stop.is_set():
                    return
                try:
                    self._read_one(path, slot)
                except CacheFileError as exc:
                    self._pieces.put(("error", slot, exc))
                except OSError as exc:
                    self._pieces.put(("error", slot, CacheFileError(f"unreadable: {exc}")))
        except Exception as exc:  # a buffer that could not be allocated (host or pinned memory): stop, blame no file
            self._aborted = f"{type(exc).__name__}: {exc}"
        finally:
            self._pieces.put(None)

    def _read_one(self, path: Path, slot: int) -> None:
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                try:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a hint: longer read-ahead
                except OSError:
                    pass
            head = _header_of(f, self._signature)
            self.read_bytes += int(head["header_bytes"])
            payload = int(head["payload_bytes"])
            view = self._buffer(slot, payload).data.cast("B")
            pos = 0
            while pos < payload:
                if self._stop.is_set():
                    raise CacheFileError("not read (the reader stopped)")
                n = f.readinto(view[pos:min(payload, pos + PIECE_BYTES)])
                if not n:
                    raise CacheFileError("truncated")
                self._pieces.put(("piece", slot, pos, pos + n))
                pos += n
                self.read_bytes += n
        self._pieces.put(("done", slot, head))

    def _check(self) -> None:
        crc = 0
        try:
            while True:
                msg = self._pieces.get()
                if msg is None:
                    return
                kind, slot = msg[0], msg[1]
                buf = self._bufs[slot]
                if kind == "piece":
                    assert buf is not None
                    crc = zlib.crc32(buf[msg[2]:msg[3]], crc)
                    continue
                if kind == "error":
                    self._ready.put((None, None, slot, msg[2]))
                else:
                    head = msg[2]
                    assert buf is not None
                    try:
                        if crc != int(head.get("crc32", -1)):
                            raise CacheFileError("corrupt payload (CRC mismatch)")
                        arrays = _arrays_of(head, buf[:int(head["payload_bytes"])])
                    except (TypeError, ValueError):
                        self._ready.put((None, None, slot, CacheFileError("corrupt header")))
                    except CacheFileError as exc:
                        self._ready.put((None, None, slot, exc))
                    else:
                        self._ready.put((head, arrays, slot, None))
                crc = 0
        finally:
            self._ready.put(None)


class BlockWriter:
    """Writes cache files on a thread of its own, in the order submitted (a block's parent before it), so a
    request's end does not wait for the disk.

    The thread starts with the first write and ends once it has been idle a second; it is not a daemon thread,
    so an interpreter that exits waits for the writes already submitted.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, root: Path, name: str, header: dict[str, Any], arrays: dict[str, np.ndarray],
               done: Callable[[int, OSError | None], None]) -> None:
        """Queue ``write_block(root, name, header, arrays)``; ``done(size, None)`` or ``done(0, error)`` is called
        on the writer's thread once it is written (``arrays`` must not change until then)."""
        with self._lock:
            self._pending += 1
            self._jobs.put((root, name, header, arrays, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tandem-cache-write", daemon=False)
                self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted write is done (and its ``done`` called); False on a timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while True:
            try:
                root, name, header, arrays, done = self._jobs.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    if self._pending == 0:
                        self._thread = None
                        return
                continue
            try:
                try:
                    size, err = write_block(root, name, header, arrays), None
                except OSError as exc:
                    size, err = 0, exc
                done(size, err)
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()
