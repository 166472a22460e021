"""prefill_partial's launch geometry (cuda/attention_tree.cu), shared by its launchers: the exact prefill and the
tree verify's chunks below P (attention_tree.py) and the long-context decode (attention_decode.py DecodeStep), and
the device limits it depends on (opt-in shared memory, multiprocessors), read once per device.
"""

from __future__ import annotations

import functools

from tandem.backend.cuda.loader import cupy

# prefill_partial: at most PX_ROWS query rows (tokens × G heads of one KV head) a block, each over
# decode's 64-row chunks; a launch takes at most PX_TOKENS tokens, so its partials stay [ceil(P / 64), 64 · H, D].
PX_ROWS = 72
PX_SCS = 72  # sc's row stride in floats (PX_SCS in cuda/attention_tree.cu)
PX_TOKENS = 64
PX_WARPS = 16  # prefill_partial's warps a block (PX_WARPS in cuda/attention_tree.cu)
PX_SPLIT_COST = 1.0  # a block's fixed cost (its query rows, the first chunk's rows) in chunk iterations
CHUNK = 64  # decode's key chunk (ATTN_CHUNK in cuda/attention_common.cuh)


def px_smem(d: int) -> int:
    """prefill_partial's dynamic shared memory in bytes at head dim `d`: K and V of a chunk (as floats, whatever the
    storage), the query rows and their scores."""
    return 4 * (2 * CHUNK * d + PX_ROWS * d + PX_ROWS * PX_SCS)


@functools.lru_cache(maxsize=None)
def _device_smem_optin(device: int) -> int:
    return int(cupy().cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"])


def smem_optin() -> int:
    """The current device's most dynamic shared memory a block may take (bytes)."""
    return _device_smem_optin(int(cupy().cuda.Device().id))


@functools.lru_cache(maxsize=4096)
def prefill_grid(tokens: int, group: int, hkv: int, chunks: int, sms: int) -> tuple[int, int, int, int]:
    """prefill_partial's grid for `tokens` query tokens over `chunks` key chunks: (tokens a tile, tiles, chunks a
    split, splits). Tiles: the fewest of ≤ PX_ROWS rows, evened out. Splits: the chunk run that minimises the
    launch's makespan on `sms` multiprocessors, one block each: waves · (chunks a block + PX_SPLIT_COST)."""
    tiles = -(-tokens * group // PX_ROWS)
    while -(-tokens // tiles) * group > PX_ROWS:
        tiles += 1
    tile = -(-tokens // tiles)
    tiles = -(-tokens // tile)
    best: tuple[float, int] | None = None
    for per in range(1, chunks + 1):
        splits = -(-chunks // per)
        if per > 1 and -(-chunks // (per - 1)) == splits:
            continue  # the same splits with fewer chunks each
        cost = -(-tiles * hkv * splits // sms) * (per + PX_SPLIT_COST)
        if best is None or cost < best[0]:
            best = (cost, per)
    assert best is not None
    per = best[1]
    return tile, tiles, per, -(-chunks // per)


@functools.lru_cache(maxsize=None)
def _device_multiprocessors(device: int) -> int:
    return int(cupy().cuda.Device(device).attributes["MultiProcessorCount"])


def multiprocessors() -> int:
    """The current device's multiprocessor count (prefill_partial's grid: a split of the chunks fills them)."""
    return _device_multiprocessors(int(cupy().cuda.Device().id))
