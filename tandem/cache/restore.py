"""Restoring a cached chain of blocks into a fresh state (tandem/cache/store.py's ``PrefixCache.restore``).

The chain is walked in position order: each block's view rows are copied into the state, the last block's
sections too (its logits and every block's hidden rows are returned when asked for). Blocks in a memory tier are
copied from their arrays (a host-tier block after its device-to-host copies have landed). Blocks on disk are read
ahead by a ``disk.BlockReader`` (a thread reading into a fixed ring of reusable host buffers, pinned for a device
state, and a thread checking each CRC as the pieces arrive) while the blocks already checked are uploaded straight
from the ring (one copy each, no staging array) and promoted to a memory tier where one has room. A file that
fails its checks is dropped with one warning (and the blocks after it) and the restore starts over without it:
the rows it had written are zeroed first, so the state is as fresh as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.cache import arrays, disk
from tandem.cache.index import DISK, HOST, RESIDENT, Block

log = logging.getLogger("tandem.cache")
_ABORTED = -2  # _take_file's slot when the reader gave up on its own


@dataclass
class CacheHit:
    """What a restore put into the state: ``length`` tokens (0: a miss), the last position's logits when the whole
    prompt was restored, the restored tokens' post-final-norm hidden rows [length, E] when asked for, and ``tier``:
    the slowest tier a restored block came from ("resident", "host", "disk"; "" for a miss)."""

    length: int = 0
    logits: Any = None
    hidden: np.ndarray | None = None
    tier: str = ""


def restore_chain(cache: Any, salt: str, ids: list[int], state: Any, need_hidden: bool) -> CacheHit:
    """Copy the longest usable cached prefix of ``ids`` into the fresh ``state`` for ``cache``, the
    tandem/cache/store.py ``PrefixCache`` whose lock the caller holds (typed Any here: store.py imports this
    module). Returns the CacheHit (length 0: a miss, the state untouched)."""
    ref = state.buffers[state.specs[0].name]
    cache._device = arrays.on_device(ref)
    chain = cache._usable(cache.index.walk(salt, ids), len(ids), need_hidden)
    if not chain or chain[-1].end > state.max_len:
        return CacheHit()
    last = chain[-1]
    on_disk = [b for b in chain if b.tier == DISK]
    reader = None
    if on_disk:
        assert cache.dir is not None
        reader = disk.BlockReader([cache.dir / b.file for b in on_disk], cache.signature,
                                  lambda n: arrays.host_buffer(n, cache._device),
                                  max(b.nbytes for b in on_disk), cache.read_buffers)
    hidden: list[np.ndarray] = []
    logits = None
    from_host = bool(on_disk) or any(b.tier != RESIDENT for b in chain)
    tier = DISK if on_disk else HOST if from_host else RESIDENT  # before promotions move the blocks up
    try:
        for b in chain:
            slot = -1
            if b.tier == DISK:
                assert reader is not None
                data, slot = _take_file(cache, reader, b, state)
                if data is None:
                    _zero_rows(state, b.start)
                    reader.close()
                    reader = None
                    if slot == _ABORTED:  # no file to blame: a miss
                        return CacheHit()
                    return restore_chain(cache, salt, ids, state, need_hidden)  # without the dropped block
            else:
                cache._wait(b)
                data = b.data
            _copy_in(state, b, data, b is last)
            if need_hidden:
                hidden.append(np.array(arrays.to_host(data["hidden"], False), dtype=np.float32))
            if b is last and last.end == len(ids):
                logits = arrays.like(ref, data["logits"])
            if slot >= 0:
                assert reader is not None
                _promote(cache, b, ref, [last], data)
                arrays.synchronize_all(state.buffers.values())  # every copy out of the buffer is done first
                reader.release(slot)
                cache.stats.disk_read_blocks += 1
    finally:
        if reader is not None:
            reader.close()
            cache.stats.disk_read_bytes += reader.read_bytes
    if from_host:
        arrays.synchronize_all(state.buffers.values())  # the host-tier blocks' uploads are done (evictable next)
    state.length = last.end
    cache._touch(chain)
    cache._tip = last
    return CacheHit(last.end, logits, np.concatenate(hidden) if need_hidden else None, tier)


def _take_file(cache: Any, reader: disk.BlockReader, block: Block,
               state: Any) -> tuple[dict[str, Any] | None, int]:
    """The next file of ``reader`` (that of ``block``): (arrays, buffer slot); a bad file (one whose arrays do
    not fit ``state`` too): warn, drop the block and return (None, -1); a reader that gave up (no memory for a
    buffer): warn, return (None, _ABORTED)."""
    assert cache.dir is not None
    try:
        head, data, slot = reader.take()
        problem = "header disagrees with its index entry" \
            if head.get("end") != block.end or head.get("salt") != block.salt else _misfit(state, block, data)
        if problem:
            reader.release(slot)
            raise disk.CacheFileError(problem)
    except disk.CacheFileError as exc:
        log.warning("cache: ignoring %s: %s (removed)", cache.dir / block.file, exc)
        cache.stats.disk_errors += 1
        cache.stats.disk_read_bytes += reader.read_bytes
        reader.read_bytes = 0
        cache._drop(block)
        return None, -1
    except disk.ReadAborted as exc:
        log.warning("cache: a disk restore stopped at %s: %s (served as a miss)", cache.dir / block.file, exc)
        cache.stats.disk_errors += 1
        return None, _ABORTED
    return data, slot


def _misfit(state: Any, block: Block, data: dict[str, Any]) -> str:
    """What keeps ``data`` from being ``block``'s arrays in ``state``'s layout ("" when nothing): each view's rows
    [end - start, ...] and, for a restore point, each section, in the state's shapes and dtypes; the logits and
    hidden rows its flags promise."""
    for spec in state.specs:
        buf = state.buffers[spec.name]
        if spec.kind != "view" and not block.has_sections:
            continue
        shape = (block.end - block.start, *buf.shape[1:]) if spec.kind == "view" else tuple(buf.shape)
        arr = data.get(spec.name)
        if arr is None or tuple(arr.shape) != shape or arr.dtype != buf.dtype:
            return f"its array {spec.name} does not fit the state"
    for key, flag in (("logits", block.has_logits), ("hidden", block.has_hidden)):
        if flag and key not in data:
            return f"its {key} are missing"
    return ""


def _copy_in(state: Any, block: Block, data: dict[str, Any], sections: bool) -> None:
    """``block``'s view rows (and with ``sections`` its sections) from ``data`` into ``state``."""
    for spec in state.specs:
        if spec.kind == "view":
            arrays.assign(state.buffers[spec.name][block.start:block.end], data[spec.name])
        elif sections:
            arrays.assign(state.buffers[spec.name], data[spec.name])


def _zero_rows(state: Any, end: int) -> None:
    """Zero the view rows [0, end) a restore wrote before it gave up (the state is as fresh again)."""
    for spec in state.specs:
        if spec.kind == "view" and end > 0:
            state.buffers[spec.name][:end] = 0


def _promote(cache: Any, block: Block, ref: Any, extra: list[Block], data: dict[str, np.ndarray]) -> None:
    """Keep a copy of ``data``, a block just read from disk (views of a reader's buffer), in a memory tier where
    one has room (its file stays); else keep nothing."""
    tier = cache._room(block.nbytes, extra)
    if tier is None:
        return
    if tier == RESIDENT:
        block.data = {k: arrays.upload(v) if cache._device else np.array(v) for k, v in data.items()}
    else:
        block.data = {k: arrays.pinned_copy(v) for k, v in data.items()}
    block.tier = tier
    cache.used[tier] += block.nbytes
