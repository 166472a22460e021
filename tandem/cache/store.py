"""The prefix cache: snapshots of sequences in three tiers, found by their token ids, restored exactly.

Tiers (DESIGN.md, "Caches"), each with a byte budget checked with an estimate before anything is copied (a block
that cannot fit is refused, never half-taken):
- resident: beside the running state (device memory for a device state; host memory for a host state);
- host: pinned host memory, the blocks spilled from the device tier (a host state has no host tier: its resident
  tier already is host memory, so its blocks spill straight to the disk tier);
- disk: files in ``cache_dir`` (tandem/cache/disk.py), written at the end of a request, surviving restarts;
  read back and checked (signature, size, CRC) when used: a restore reads its files ahead on threads into
  ``read_buffers`` reusable host buffers (pinned for a device state) while it copies the blocks already checked
  into the state (``disk.BlockReader``).
Spills from the device to the host tier are queued on the current stream (``arrays.download``) and waited for only
where the host copy is read (a restore, a disk write), so a prefill that fills the device tier goes on queuing.
Eviction: least recently used first, by bytes; a tier's victim moves one tier down (resident → host → disk, as
far as the tiers exist) and is dropped, with the blocks after it, when none is left. The blocks of the
``protect_recent`` latest requests (and of the running one) are never evicted: a request that finds no room
besides them takes no snapshot (a later request misses; none fails).

Exactness: a block holds copies of the state's bits; a restore copies them back. What makes the continuation equal
to a fresh prefill is where snapshots are taken (tandem/cache/sequence.py): at grid positions of its chunked
prefill, at a prompt's end only for a chunk-invariant prefill (``Capabilities.prefill_chunk_invariant``), and after
decode steps only for a model whose prefill computes decode's bits (``Capabilities.prefill_matches_decode``).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from tandem.cache import arrays, disk
from tandem.cache.index import DISK, HOST, RESIDENT, TIERS, Block, PrefixIndex
from tandem.cache.restore import CacheHit, restore_chain

log = logging.getLogger("tandem.cache")
GB = 1 << 30


@dataclass
class CacheStats:
    """Counters since the cache was made (or cleared: its entries, never its counters)."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    snapshots: int = 0
    refused: int = 0
    disk_errors: int = 0
    disk_read_bytes: int = 0
    disk_read_blocks: int = 0
    spills: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})


class PrefixCache:
    """Snapshots of sequences, by salt and token ids.

    Args:
        chunk: the snapshot grid in tokens (``--prefix-chunk``).
        resident_bytes, host_bytes, disk_bytes: the tiers' budgets (0 turns a tier off).
        cache_dir: the disk tier's folder (None: no disk tier). signature: the disk tier's identity
            (tandem/cache/signature.py); required with ``cache_dir``.
        protect_recent: requests whose blocks are never evicted (besides the running one).
        read_buffers: host buffers a disk restore reads into (each the size of the largest block it reads).
        background_writes: write the disk tier's files on a thread of their own (``disk.BlockWriter``), so a
            request's end does not wait for the disk; ``wait_writes`` waits for them.
    Raises: ValueError: a negative budget, a ``cache_dir`` without a signature, or an unusable folder.
    All public methods hold one lock (the server reads and clears the cache from another thread).
    """

    def __init__(self, chunk: int, resident_bytes: int, host_bytes: int = 0, cache_dir: str | Path | None = None,
                 disk_bytes: int = 20 * GB, signature: str = "", protect_recent: int = 4,
                 read_buffers: int = 3, background_writes: bool = False) -> None:
        if min(resident_bytes, host_bytes, disk_bytes) < 0:
            raise ValueError("cache budgets must be >= 0 bytes")
        if cache_dir is not None and not signature:
            raise ValueError("a disk tier needs the model's signature")
        self.index = PrefixIndex(chunk)
        self.chunk = chunk
        self.budget = {RESIDENT: int(resident_bytes), HOST: int(host_bytes),
                       DISK: int(disk_bytes) if cache_dir is not None else 0}
        self.used = {t: 0 for t in TIERS}
        self.signature = signature
        self.dir = disk.open_dir(cache_dir) if cache_dir is not None else None
        self.protect_recent = max(0, protect_recent)
        self.read_buffers = max(2, read_buffers)
        self.writer = disk.BlockWriter() if background_writes and cache_dir is not None else None
        self._writing: dict[int, int] = {}  # id(block) -> disk bytes reserved while the writer writes its file
        self.stats = CacheStats()
        self.lock = threading.RLock()
        self._clock = 0
        self._recent: list[Block | None] = []  # the latest requests' tips (None: it published nothing)
        self._tips: dict[int, Block | None] = {}  # each running request's latest block, by its thread (``_tip``)
        self._unwritten: list[Block] = []
        self._device = False  # whether blocks are taken from a device state (set by the first snapshot)
        if self.dir is not None:
            self._scan()

    # ------------------------------------------------------------------------------------------- requests
    @property
    def _tip(self) -> Block | None:
        """The calling thread's running request's latest block (requests run one a thread: tandem/slots.py)."""
        return self._tips.get(threading.get_ident())

    @_tip.setter
    def _tip(self, block: Block | None) -> None:
        if block is None:
            self._tips.pop(threading.get_ident(), None)
        else:
            self._tips[threading.get_ident()] = block

    def begin(self, salt: str) -> None:
        """Start a request under ``salt``: its blocks are protected until ``protect_recent`` later requests end."""
        with self.lock:
            self._tip = self.index.root(salt)

    def end(self) -> None:
        """End the running request: protect its blocks among the recent ones and write its new blocks to disk."""
        with self.lock:
            tip, self._tip = self._tip, None
            if tip is not None and tip.parent is not None:
                self._recent = ([b for b in self._recent if b is not tip] + [tip])[-self.protect_recent:] \
                    if self.protect_recent else []
            elif tip is not None and self.protect_recent:  # it holds nothing, yet it is one of the later requests
                self._recent = (self._recent + [None])[-self.protect_recent:]
            self._flush()

    def count_prefill(self, num_tokens: int) -> None:
        """Count tokens the engine prefilled (not restored)."""
        with self.lock:
            self.stats.prefilled_tokens += num_tokens

    # ------------------------------------------------------------------------------------------- lookup
    def restore(self, salt: str, ids: list[int], state: Any, need_hidden: bool = False) -> CacheHit:
        """Copy the longest usable cached prefix of ``ids`` into ``state`` (a fresh one: length 0).

        The restore point is the latest snapshot with sections whose ids equal ids[:end] (every id compared),
        end < len(ids) unless it kept the last position's logits, every block before it holding its rows (and
        hidden rows when ``need_hidden``). A block that fails to load from disk is dropped with a warning and the
        restore uses what is before it.
        Returns CacheHit (length 0: a miss; the state is untouched).
        """
        with self.lock:
            hit = restore_chain(self, salt, ids, state, need_hidden)
            if hit.length:
                self.stats.hits += 1
                self.stats.reused_tokens += hit.length
            else:
                self.stats.misses += 1
            return hit

    def _usable(self, chain: list[Block], n: int, need_hidden: bool) -> list[Block]:
        """The longest prefix of ``chain`` ending at a restore point for a prompt of ``n`` tokens."""
        if need_hidden:
            cut = next((i for i, b in enumerate(chain) if not b.has_hidden), len(chain))
            chain = chain[:cut]
        for j in range(len(chain) - 1, -1, -1):
            b = chain[j]
            if b.has_sections and (b.end < n or b.has_logits):
                return chain[:j + 1]
        return []

    # ------------------------------------------------------------------------------------------- snapshots
    def snapshot(self, salt: str, ids: list[int], state: Any, start: int, end: int | None = None,
                 sections: bool = True, logits: Any = None, hidden: np.ndarray | None = None) -> bool:
        """Publish the block ids[start:end] (``end`` defaults to state.length) of the running ``state``: its view
        rows, and with
        ``sections`` the state's sections (a restore point), the last position's ``logits`` [V] and the block's
        ``hidden`` rows [end-start, E] when given. ``start`` is a grid position whose block is cached (or 0), and
        the block ends at the next grid position or before it.

        Returns True when the block is findable (taken now or already cached with as much); False when refused
        (no room outside protected blocks, or its parent is not cached). The block is findable only once copied.
        Raises: ValueError: a block off the grid, or sections asked for at an ``end`` other than state.length.
        """
        with self.lock:
            end = state.length if end is None else end
            if sections and end != state.length:
                raise ValueError("a snapshot's sections are the state's at its length")
            if not 0 <= start < end <= min(len(ids), state.length) or start % self.chunk or end - start > self.chunk:
                raise ValueError(f"a snapshot of [{start}, {end}) is off the {self.chunk}-token grid")
            parent = self.index.find(salt, ids, start)
            if parent is None or (parent.parent is not None and parent.tier == ""):
                self.stats.refused += 1
                return False
            key = tuple(ids[start:end])
            have = self.index.child(parent, key, self.chunk)
            want_logits, want_hidden = logits is not None and sections, hidden is not None
            if have is not None and have.tier != "" and (have.has_sections or not sections) \
                    and (have.has_logits or not want_logits) and (have.has_hidden or not want_hidden):
                self._touch(have.chain())
                self._tip = have
                return True
            nbytes = self._estimate(state, end - start, sections, logits if want_logits else None, hidden)
            self._device = arrays.on_device(next(iter(state.buffers.values())))
            tier = self._room(nbytes, [parent] + ([have] if have is not None else []))
            if tier is None:
                self.stats.refused += 1
                return False
            data = self._take(state, start, end, sections, logits if want_logits else None, hidden, tier)
            block = have if have is not None else self.index.add(parent, key)
            if have is not None:
                self._drop_data(have)
                self._unlink(have)
            block.data, block.nbytes, block.tier = data, nbytes, tier
            if tier == HOST:
                self._spill(block)
            block.has_sections, block.has_logits, block.has_hidden = sections, want_logits, want_hidden
            self.used[tier] += nbytes
            self._touch(block.chain())
            self._tip = block
            self.stats.snapshots += 1
            if self.dir is not None and block not in self._unwritten:
                self._unwritten.append(block)
            return True

    def _estimate(self, state: Any, rows: int, sections: bool, logits: Any, hidden: np.ndarray | None) -> int:
        n = 0
        for spec in state.specs:
            if spec.kind == "view":
                n += rows * arrays.spec_rows_nbytes(spec.shape, spec.dtype)
            elif sections:
                n += arrays.spec_nbytes(spec.shape, spec.dtype)
        n += int(logits.nbytes) if logits is not None else 0
        return n + (int(hidden.nbytes) if hidden is not None else 0)

    def _take(self, state: Any, start: int, end: int, sections: bool, logits: Any, hidden: np.ndarray | None,
              tier: str) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for spec in state.specs:
            buf = state.buffers[spec.name]
            if spec.kind == "view":
                data[spec.name] = arrays.copy_of(buf[start:end])
            elif sections:
                data[spec.name] = arrays.copy_of(buf)
        if logits is not None:
            data["logits"] = arrays.copy_of(logits)
        if hidden is not None:
            data["hidden"] = np.array(hidden, dtype=np.float32)
        return data

    # ------------------------------------------------------------------------------------------- tiers
    def _protected(self, extra: list[Block]) -> set[int]:
        keep: set[int] = set()
        tips = [b for b in self._recent if b is not None]
        for tip in tips + [b for b in self._tips.values() if b is not None] + extra:
            keep.update(id(b) for b in tip.chain())
        return keep

    def _room(self, nbytes: int, extra: list[Block]) -> str | None:
        """The memory tier a new block of ``nbytes`` goes to after evictions, or None (refused)."""
        tiers = [RESIDENT, HOST] if self._device else [RESIDENT]
        keep = self._protected(extra)
        for tier in tiers:
            if nbytes <= self.budget[tier] and self._evict(tier, nbytes, keep):
                return tier
        return None

    def _evict(self, tier: str, nbytes: int, keep: set[int]) -> bool:
        """Evict ``tier``'s least recently used unprotected blocks until ``nbytes`` more fit; False if they cannot."""
        if self.used[tier] + nbytes <= self.budget[tier]:
            return True
        victims = sorted((b for b in self.index.blocks if b.tier == tier and id(b) not in keep),
                         key=lambda b: b.last_used)
        for victim in victims:
            if victim.tier != tier:
                continue  # dropped with an earlier victim's subtree
            self._demote(victim, keep)
            self.stats.evictions[tier] += 1
            if self.used[tier] + nbytes <= self.budget[tier]:
                return True
        return self.used[tier] + nbytes <= self.budget[tier]

    def _demote(self, block: Block, keep: set[int]) -> None:
        """Move ``block`` one tier down (resident → host → disk), or drop it and the blocks after it."""
        if block.tier == RESIDENT and self._device and block.nbytes <= self.budget[HOST] \
                and self._evict(HOST, block.nbytes, keep | {id(block)}):
            self.used[RESIDENT] -= block.nbytes
            block.tier = HOST
            self.used[HOST] += block.nbytes
            self._spill(block)
            return
        if block.file and block not in self._unwritten:
            self._drop_data(block)
            block.tier = DISK
            return
        self._drop(block)

    def _spill(self, block: Block) -> None:
        """Replace ``block``'s device arrays (in the host tier's bookkeeping already) by pinned host copies,
        queued on the current stream (``block.pending`` until they land). Host arrays stay as they are."""
        events, host = [], {}
        for k, v in block.data.items():
            if arrays.on_device(v):
                host[k], event = arrays.download(v)
                events.append(event)
            else:
                host[k] = v
        block.data = host
        block.pending = events[-1] if events else None  # one stream: the last copy's event covers them all
        self.stats.spills += 1

    @staticmethod
    def _wait(block: Block) -> None:
        """Wait for a spilled block's device-to-host copies (nothing when none is in flight)."""
        if block.pending is not None:
            block.pending.synchronize()
            block.pending = None

    def _drop_data(self, block: Block) -> None:
        if block.tier in (RESIDENT, HOST):
            self.used[block.tier] -= block.nbytes
        self._wait(block)  # its pinned memory is not handed out again while a copy still writes into it
        block.data = None

    def _drop(self, block: Block) -> None:
        """Remove ``block`` and its subtree from the index, every tier and the disk."""
        for b in block.subtree():  # before index.remove, which empties their tiers
            if b.tier in (RESIDENT, HOST):
                self.used[b.tier] -= b.nbytes
        for b in self.index.remove(block):
            self._wait(b)
            b.tier = ""
            b.data = None
            self._unlink(b)
            if b in self._unwritten:
                self._unwritten.remove(b)
        self._recent = [b for b in self._recent if b is None or b.tier != ""]

    def _touch(self, chain: list[Block]) -> None:
        self._clock += 1
        for b in chain:
            b.last_used = self._clock

    # ------------------------------------------------------------------------------------------- disk tier
    def _unlink(self, block: Block) -> None:
        if block.file and self.dir is not None:
            disk.remove(self.dir / block.file)
            self.used[DISK] -= block.file_bytes
        block.file, block.file_bytes = "", 0

    def _flush(self) -> None:
        """Write the blocks taken since the last flush, parents first (a full disk tier skips them); with a
        background writer the files are written on its thread, their bytes reserved in the disk tier's budget
        until then."""
        pending, self._unwritten = self._unwritten, []
        if self.dir is None:
            return
        keep = self._protected([])
        for block in sorted(pending, key=lambda b: b.end):
            if block.tier not in (RESIDENT, HOST) or block.file or id(block) in self._writing:
                continue
            parent = block.parent
            if parent is not None and parent.parent is not None and not parent.file \
                    and id(parent) not in self._writing:
                continue  # its parent is not on disk: after a restart it could not be restored
            ids = [t for b in block.chain() for t in b.key]
            header = {"signature": self.signature, "salt": block.salt, "tokens": ids, "start": block.start,
                      "end": block.end, "has_sections": block.has_sections, "has_logits": block.has_logits,
                      "has_hidden": block.has_hidden}
            # every byte the file will hold: the payload, this header as written (its salt and ids included) and
            # room for the array table and the sizes write_block adds
            reserve = block.nbytes + len(orjson.dumps(header)) + (1 << 16)
            if not self._disk_room(reserve, keep):
                continue
            name = disk.block_name(block.salt, ids)
            self._wait(block)
            host = {k: arrays.to_host(v, False) for k, v in block.data.items()}
            if self.writer is not None:
                self._writing[id(block)] = reserve
                self.used[DISK] += reserve
                self.writer.submit(self.dir, name, header, host, functools.partial(self._written, block, name))
                continue
            try:
                size = disk.write_block(self.dir, name, header, host)
            except OSError as exc:
                self._written(block, name, 0, exc)
                continue
            self._written(block, name, size, None)

    def _written(self, block: Block, name: str, size: int, err: OSError | None) -> None:
        """A block's file is written (or failed): publish it, or remove it when the block went meanwhile."""
        assert self.dir is not None
        with self.lock:
            self.used[DISK] -= self._writing.pop(id(block), 0)
            if err is not None:
                log.warning("cache: could not write %s: %s", self.dir / name, err)
                self.stats.disk_errors += 1
                return
            if block.tier == "" or block.file:  # dropped or cleared while it was written
                disk.remove(self.dir / name)
                return
            block.file, block.file_bytes = name, size
            self.used[DISK] += size

    def wait_writes(self, timeout_s: float | None = None) -> bool:
        """Wait for the background writer's files (call without holding ``lock``); False on a timeout."""
        return self.writer.wait(timeout_s) if self.writer is not None else True

    def _disk_room(self, nbytes: int, keep: set[int]) -> bool:
        if nbytes > self.budget[DISK]:
            return False
        victims = sorted((b for b in self.index.blocks if b.file and id(b) not in keep), key=lambda b: b.last_used)
        for victim in victims:
            if self.used[DISK] + nbytes <= self.budget[DISK]:
                break
            if not victim.file:
                continue
            self.stats.evictions[DISK] += 1
            if victim.tier == DISK:
                self._drop(victim)
            else:  # still in memory: only its file goes (and those of the blocks after it, useless without it)
                for b in victim.subtree():
                    self._unlink(b)
        return self.used[DISK] + nbytes <= self.budget[DISK]

    def _scan(self) -> None:
        """Index the disk tier's files: bad ones are removed with a warning, parents before their blocks."""
        assert self.dir is not None
        for part in self.dir.glob("*" + disk.PART_SUFFIX):
            if part.is_file():
                log.warning("cache: ignoring %s: a write cut short (removed)", part)
                self.stats.disk_errors += 1
                disk.remove(part)
        heads = []
        for path in self.dir.glob("*" + disk.SUFFIX):
            if not path.is_file():
                continue  # not one of ours (a folder of that name)
            try:
                heads.append((disk.read_header(path, self.signature), path))
            except disk.CacheFileError as exc:
                log.warning("cache: ignoring %s: %s (removed)", path, exc)
                self.stats.disk_errors += 1
                disk.remove(path)
        heads.sort(key=lambda hp: (int(hp[0].get("end", 0)), hp[1].stat().st_mtime))
        for head, path in heads:
            why = self._adopt(head, path)
            if why:  # every removed file gets its line and its count
                log.warning("cache: ignoring %s: %s (removed)", path, why)
                self.stats.disk_errors += 1
                disk.remove(path)

    def _adopt(self, head: dict[str, Any], path: Path) -> str:
        """Index one file found by `_scan`; returns "" when adopted, else why it cannot be."""
        try:
            ids = [int(t) for t in head["tokens"]]
            start, end, salt = int(head["start"]), int(head["end"]), str(head["salt"])
            size = int(head["file_bytes"])
        except (KeyError, TypeError, ValueError):
            return "its header lacks the block's fields"
        if end != len(ids) or start % self.chunk or not 0 <= start < end <= start + self.chunk:
            return f"its span {start}..{end} is not a block of the {self.chunk}-token grid"
        parent = self.index.find(salt, ids, start)
        if parent is None:
            return "the block before it is not on disk"
        if self.index.child(parent, tuple(ids[start:end]), self.chunk) is not None:
            return "another file holds the same block"
        if self.used[DISK] + size > self.budget[DISK]:
            return "the disk tier's budget is full"
        block = self.index.add(parent, tuple(ids[start:end]))
        block.tier, block.file, block.file_bytes = DISK, path.name, size
        block.nbytes = int(head["payload_bytes"])
        block.has_sections = bool(head.get("has_sections"))
        block.has_logits = bool(head.get("has_logits"))
        block.has_hidden = bool(head.get("has_hidden"))
        self.used[DISK] += size
        return ""

    # ------------------------------------------------------------------------------------------- surface
    def clear(self) -> int:
        """Drop every block from every tier (files included); returns how many. Counters are kept."""
        with self.lock:
            gone = self.index.clear()
            for b in gone:
                self._wait(b)
                b.data = None
                self._unlink(b)
            self.used = {t: 0 for t in TIERS}
            self.used[DISK] = sum(self._writing.values())  # files still being written: removed once written
            self._recent, self._unwritten = [], []
            self._tips.clear()
        arrays.release_freed_memory()  # the dropped blocks' pages back to the system, not kept in malloc's arenas
        return len(gone)

    def info(self) -> dict[str, Any]:
        """Entries, bytes and budgets per tier, and the counters (JSON-ready)."""
        with self.lock:
            tiers: dict[str, Any] = {}
            for t in TIERS:
                entries = sum(1 for b in self.index.blocks if (b.file if t == DISK else b.tier == t))
                tiers[t] = {"entries": entries, "bytes": self.used[t], "budget_bytes": self.budget[t],
                            "evictions": self.stats.evictions[t]}
            s = self.stats
            return {"prefix_chunk": self.chunk, "tiers": tiers, "hits": s.hits, "misses": s.misses,
                    "reused_tokens": s.reused_tokens, "prefilled_tokens": s.prefilled_tokens,
                    "snapshots": s.snapshots, "refused": s.refused, "disk_errors": s.disk_errors,
                    "spills": s.spills, "disk_read_bytes": s.disk_read_bytes,
                    "disk_read_blocks": s.disk_read_blocks,
                    "disk_dir": str(self.dir) if self.dir is not None else None}
