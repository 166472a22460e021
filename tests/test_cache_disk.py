"""The disk tier's read-ahead (tandem/cache/disk.py ``BlockReader``): files come back in order with the arrays
``write_block`` wrote, through a fixed ring of reused buffers; a corrupt, truncated or foreign file is reported
for itself (CacheFileError) and the files around it still load; ``close`` stops reading early."""

from __future__ import annotations

from pathlib import Path

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
    with pytest.raises(disk.CacheFileError):
        reader.take()
