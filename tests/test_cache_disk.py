"""The disk tier's threads (tandem/cache/disk.py): ``BlockReader`` returns files in order with the arrays
``write_block`` wrote, through a fixed ring of reused buffers; a corrupt, truncated or foreign file is reported
for itself (CacheFileError) and the files around it still load; ``close`` stops reading early. ``BlockWriter``
writes in submission order off the caller's thread; the store's background flush publishes a block's file only
once written, and a block dropped meanwhile leaves no file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.cache import disk


def write(root: Path, k: int, rows: int = 3000) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(k)
    arrays = {"k": rng.standard_normal((rows, 64)).astype(np.float32), "s": rng.integers(0, 9, (7,))}
    name = f"b{k}{disk.SUFFIX}"
    disk.write_block(root, name, {"signature": "sig", "end": k}, arrays)
    return root / name, arrays


def test_reader_returns_every_file_in_order_through_a_bounded_ring(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "PIECE_BYTES", 1 << 16)  # many pieces a file: the CRC runs behind the reads
    files = [write(tmp_path, k) for k in range(7)]
    allocated: list[int] = []

    def alloc(n: int) -> np.ndarray:
        allocated.append(n)
        return np.empty(n, dtype=np.uint8)

    reader = disk.BlockReader([p for p, _ in files], "sig", alloc, num_buffers=3)
    try:
        for k, (path, want) in enumerate(files):
            head, got, slot = reader.take()
            assert head["end"] == k, "files must come back in the order given"
            assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)
            reader.release(slot)
    finally:
        reader.close()
    assert len(allocated) <= 3, f"{len(allocated)} buffers allocated for a ring of 3"
    assert reader.read_bytes == sum(p.stat().st_size for p, _ in files)


def test_reader_reports_bad_files_and_reads_on(tmp_path: Path) -> None:
    files = [write(tmp_path, k, rows=200) for k in range(5)]
    raw = bytearray(files[1][0].read_bytes())
    raw[-9] ^= 0x40
    files[1][0].write_bytes(bytes(raw))                                # a flipped payload bit
    files[2][0].write_bytes(files[2][0].read_bytes()[:-5])             # cut short
    disk.write_block(tmp_path, files[3][0].name, {"signature": "other", "end": 3}, files[3][1])  # foreign
    reader = disk.BlockReader([p for p, _ in files], "sig", lambda n: np.empty(n, np.uint8), num_buffers=2)
    try:
        reasons = []
        for k in range(5):
            try:
                head, got, slot = reader.take()
            except disk.CacheFileError as exc:
                reasons.append(str(exc))
                continue
            assert head["end"] == k and np.array_equal(got["k"], files[k][1]["k"])
            reader.release(slot)
    finally:
        reader.close()
    assert len(reasons) == 3
    assert "CRC" in reasons[0] and "truncated" in reasons[1] and "another model" in reasons[2], reasons


def test_reader_closed_early_stops(tmp_path: Path) -> None:
    files = [write(tmp_path, k) for k in range(6)]
    reader = disk.BlockReader([p for p, _ in files], "sig", lambda n: np.empty(n, np.uint8), num_buffers=2)
    head, _, slot = reader.take()
    assert head["end"] == 0
    reader.close()  # with one buffer still held and the reader waiting for it
    assert reader.read_bytes < sum(p.stat().st_size for p, _ in files)
    with pytest.raises(disk.ReadAborted):
        reader.take()


def two_blocks(root: Path) -> tuple[Any, list[Any], list[int]]:
    """(a disk-tier PrefixCache at ``root`` on a 16-token grid holding two blocks of 32 ids: rows-only [0, 16) and
    the restore point [16, 32); the state's specs; the ids)."""
    from tandem.cache.store import PrefixCache
    from tandem.models.state import BufferSpec, ModelState

    specs = [BufferSpec("k", (64, 2), "float32", "view"), BufferSpec("s", (3,), "float32", "section")]
    cache = PrefixCache(16, 1 << 20, cache_dir=root, signature="sig")
    state = ModelState(specs, 64)
    ids = list(range(32))
    state.length = 32
    cache.begin("")
    assert cache.snapshot("", ids, state, 0, 16, sections=False) and cache.snapshot("", ids, state, 16)
    cache.end()
    return cache, specs, ids

def test_reader_without_memory_aborts_and_blames_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [write(tmp_path, k) for k in range(3)]

    def no_memory(n: int) -> np.ndarray:
        raise MemoryError(f"{n} bytes")

    reader = disk.BlockReader([p for p, _ in files], "sig", no_memory)
    with pytest.raises(disk.ReadAborted, match="MemoryError"):
        reader.take()
    reader.close()
    # through the store: a miss, every file kept
    from tandem.cache import arrays
    from tandem.cache.store import PrefixCache
    from tandem.models.state import ModelState

    root = tmp_path / "tier"
    _, specs, ids = two_blocks(root)
    again = PrefixCache(16, 1 << 20, cache_dir=root, signature="sig")
    monkeypatch.setattr(arrays, "host_buffer", lambda n, pinned: no_memory(n))
    assert again.restore("", ids + [5], ModelState(specs, 64)).length == 0
    assert len(list(root.glob("*.tblk"))) == 2 and again.info()["tiers"]["disk"]["entries"] == 2
    monkeypatch.undo()
    assert again.restore("", ids + [5], ModelState(specs, 64)).length == 32


def test_writer_writes_in_order_and_reports(tmp_path: Path) -> None:
    writer = disk.BlockWriter()
    done: list[tuple[str, int, object]] = []
    for k in range(5):
        writer.submit(tmp_path, f"w{k}{disk.SUFFIX}", {"signature": "sig", "end": k},
                      {"a": np.full((1000,), k, np.float32)}, lambda size, err, k=k: done.append((f"w{k}", size, err)))
    writer.submit(tmp_path / "missing", "x.tblk", {}, {}, lambda size, err: done.append(("x", size, err)))
    assert writer.wait(30), "the writer did not finish"
    assert [d[0] for d in done] == ["w0", "w1", "w2", "w3", "w4", "x"]
    assert all(err is None and size > 4000 for _, size, err in done[:5]) and isinstance(done[5][2], OSError)
    for k in range(5):
        head, arrays = disk.read_block(tmp_path / f"w{k}{disk.SUFFIX}", "sig")
        assert head["end"] == k and np.array_equal(arrays["a"], np.full((1000,), k, np.float32))


def test_background_flush_publishes_files_once_written(tmp_path: Path) -> None:
    from tandem.cache.store import PrefixCache
    from tandem.models.state import BufferSpec, ModelState

    specs = [BufferSpec("k", (64, 2), "float32", "view"), BufferSpec("s", (3,), "float32", "section")]
    cache = PrefixCache(16, 1 << 20, cache_dir=tmp_path, signature="sig", background_writes=True)
    state = ModelState(specs, 64)
    ids = list(range(40))
    state.buffers["k"][:40] = np.arange(80, dtype=np.float32).reshape(40, 2)
    state.length = 32
    cache.begin("")
    assert cache.snapshot("", ids, state, 0, 16, sections=False) and cache.snapshot("", ids, state, 16)
    cache.end()
    assert cache.wait_writes(30)
    assert cache.info()["tiers"]["disk"]["entries"] == 2 and len(list(tmp_path.glob("*.tblk"))) == 2
    again = PrefixCache(16, 1 << 20, cache_dir=tmp_path, signature="sig")  # a restart reads both
    fresh = ModelState(specs, 64)
    assert again.restore("", ids, fresh).length == 32
    assert np.array_equal(fresh.buffers["k"][:32], state.buffers["k"][:32])
    # a block dropped before its file is written leaves no file
    cache.begin("")
    state.length = 40
    assert cache.snapshot("", ids, state, 32)
    cache.end()
    cache.clear()
    assert cache.wait_writes(30)
    assert not list(tmp_path.glob("*.tblk")) and cache.info()["tiers"]["disk"]["bytes"] == 0


def test_entries_that_cannot_be_removed_never_fail_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A folder named like a cache file, or a file the folder no longer lets go (read-only now), is warned about
    and left: the tier still starts, and clearing it (DELETE /v1/cache) still empties every tier."""
    import logging

    (tmp_path / f"x{disk.SUFFIX}").mkdir()
    (tmp_path / f"y{disk.PART_SUFFIX}").mkdir()
    cache, _, _ = two_blocks(tmp_path)
    assert cache.info()["tiers"]["disk"]["entries"] == 2

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert cache.clear() == 2
    assert all(t["entries"] == 0 and t["bytes"] == 0 for t in cache.info()["tiers"].values())
    assert sum("could not remove" in r.message for r in caplog.records) == 2


def test_every_removed_file_is_warned_about_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file that passes the header check but cannot be adopted (the block before it is gone), and a write cut
    short, each get one warning line and one disk_errors count when a restart scans the folder."""
    import logging

    from tandem.cache.store import PrefixCache

    cache, _, _ = two_blocks(tmp_path)
    first = min(tmp_path.glob("*" + disk.SUFFIX), key=lambda p: disk.read_header(p, "sig")["end"])
    first.unlink()  # the [16, 32) block's parent is gone
    (tmp_path / f".x{disk.PART_SUFFIX}").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        again = PrefixCache(16, 1 << 20, cache_dir=tmp_path, signature="sig")
    assert again.info()["disk_errors"] == 2, again.info()
    warned = [r.message for r in caplog.records if "(removed)" in r.message]
    assert len(warned) == 2 and any("block before it is not on disk" in m for m in warned)
    assert not list(tmp_path.glob("*" + disk.SUFFIX)) and not list(tmp_path.glob("*" + disk.PART_SUFFIX))


def test_disk_budget_counts_the_salt_in_each_header(tmp_path: Path) -> None:
    """Blocks under a long salt: the bytes on disk never pass the disk tier's budget (the header, salt included,
    is reserved before a file is written)."""
    from tandem.cache.store import PrefixCache
    from tandem.models.state import BufferSpec, ModelState

    specs = [BufferSpec("k", (64, 2), "float32", "view"), BufferSpec("s", (3,), "float32", "section")]
    budget = 1 << 20
    cache = PrefixCache(16, 1 << 20, cache_dir=tmp_path, signature="sig", disk_bytes=budget)
    state = ModelState(specs, 64)
    salt = "s" * 300_000  # each header holds 300 KB of salt: four files would pass the budget
    for k in range(8):
        ids = [k * 100 + i for i in range(16)]
        state.length = 16
        cache.begin(salt)
        cache.snapshot(salt, ids, state, 0)
        cache.end()
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*" + disk.SUFFIX))
    assert 0 < on_disk <= budget and cache.info()["tiers"]["disk"]["bytes"] == on_disk
