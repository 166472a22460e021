"""The CUDA launchers' grid choices, checked on the CPU (no GPU or CuPy needed): attention decode's query-head
split (`attention_decode.head_splits`) and the attn_partial instance it takes (`partial_kernel`)."""

from __future__ import annotations

from tandem.backend.cuda import attention_decode as ad
from tandem.backend.cuda.loader import CUDA_DIR


def test_head_splits_fill_the_gpu_at_short_contexts_only() -> None:
    # 27B (G = 6, Hkv = 4): 3 chunks at position 128 are 12 blocks -> one query head a block (72 blocks)
    assert ad.head_splits(6, 4 * 3) == 6
    # 9B (G = 4): 4 KV heads × 1 chunk -> 4 heads a KV head split 4 ways
    assert ad.head_splits(4, 4 * 1) == 4
    # enough chunks already: no split; in between: the smallest divisor of G that reaches the target
    assert ad.head_splits(6, 4 * 64) == 1
    assert ad.head_splits(6, 4 * 16) == 2  # 64 blocks -> 128
    assert ad.head_splits(6, 4 * 12) == 3  # 48 blocks: 2 gives 96, 3 gives 144
    for group in range(1, 9):
        for blocks in range(1, 300):
            z = ad.head_splits(group, blocks)
            assert group % z == 0, (group, blocks, z)
            assert blocks * z >= ad.SPLIT_TARGET or z == group, (group, blocks, z)
            # no smaller divisor of G reaches the target
            assert all(group % d or blocks * d < ad.SPLIT_TARGET for d in range(1, z)), (group, blocks, z)


def test_partial_kernel_holds_the_block_heads() -> None:
    assert [ad.partial_kernel(n) for n in range(1, 9)] == [
        "attn_partial_g1", "attn_partial_g2", "attn_partial_g4", "attn_partial_g4"] + ["attn_partial"] * 4
    source = (CUDA_DIR / "attention_decode.cu").read_text()
    for suffix in ("", "_g1", "_g2", "_g4"):  # each name is stamped out in the source
        assert f"ATTN_PARTIAL_KERNEL({suffix}," in source


def test_a_plan_recording_hook_belongs_to_its_thread() -> None:
    """loader.set_recorder is per thread: a hook one thread sets (a LaunchPlan recording) is not seen by another
    thread's kernel lookups, so another slot's launches made meanwhile never enter the plan."""
    import threading

    from tandem.backend.cuda import loader

    seen: list[object] = []
    hook = object()
    assert loader.set_recorder(hook) is None
    try:
        worker = threading.Thread(target=lambda: seen.append(loader.recorder()))
        worker.start()
        worker.join()
        assert seen == [None] and loader.recorder() is hook
    finally:
        assert loader.set_recorder(None) is hook
    assert loader.recorder() is None
