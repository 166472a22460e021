"""The prefix cache on the GPU (tandem/cache/, the CUDA model): a state prefilled in two calls cut anywhere equals a
one-call prefill (the tensor-core prefill's chunk invariance: what prompt-end snapshots rest on), and on the
fallback prefill a session snapshot (prefill, then decode steps) equals a cold prefill, bit for bit; requests served from the device tier, the
pinned host tier and the disk tier equal the same requests on an engine with the cache off (tokens and top-5
logprobs), greedy and seeded, with speculation off, lookup and MTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from device_helpers import assert_states_equal, decode_bits_prefill  # noqa: E402
from tandem.backend.cuda.loader import gpu_available  # noqa: E402
from tandem.cache.store import PrefixCache  # noqa: E402
from tandem.engine import DEFAULT_MODEL, Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU"),
              pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").exists(), reason="no embedded model")]

CHUNK = 64
MB = 1 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=5)
FAST = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # the run-ahead device loop


@pytest.fixture(scope="module")
def gpu() -> Engine:
    return Engine.from_pretrained(device="cuda", cache="off", max_context=2048)


def engine_with(gpu: Engine, cache: PrefixCache | None, spec: str = "off") -> Engine:
    return Engine(gpu.model, gpu.tokenizer, gpu.chat_template, 2048, gpu.eos_token_ids, gpu.name, spec, cache,
                  CHUNK)


def ids_of(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 12000, n).tolist()


def run(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[Any, ...]:
    c = engine.complete(ids, params)
    return c.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs], c.finish_reason


def test_session_snapshot_equals_a_cold_prefill_on_the_device(gpu: Engine) -> None:
    model = gpu.model
    caps = model.capabilities
    assert caps.prefill_chunk_invariant and not caps.prefill_matches_decode  # the tensor-core prefill
    prompt, tokens = ids_of(1, 150), ids_of(2, 70)
    cold = model.new_state(256)
    model.prefill(cold, prompt + tokens)
    # a cold prefill cut at any position (a restore point off the grid) continues with the same bits
    cut = model.new_state(256)
    model.prefill(cut, (prompt + tokens)[:171])
    model.prefill(cut, (prompt + tokens)[171:])
    assert_states_equal(cut, cold)
    with decode_bits_prefill(model):  # the fallback prefill has decode's bits: a decoded state is a prefilled one
        state = model.new_state(256)
        model.prefill(state, prompt)
        for t in tokens:
            model.decode(state, t)
        cold = model.new_state(256)
        model.prefill(cold, prompt + tokens)
        assert_states_equal(state, cold)


@pytest.mark.parametrize("spec", ["off", "lookup", "mtp"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED, FAST], ids=["greedy", "seeded", "run-ahead"])
def test_device_tier_requests_equal_cache_off(gpu: Engine, spec: str, params: SamplingParams) -> None:
    cold = engine_with(gpu, None, spec)
    warm = engine_with(gpu, PrefixCache(CHUNK, 512 * MB, 512 * MB), spec)
    a = ids_of(10, 140) * 2
    b = a[:200] + ids_of(11, 70)
    for ids in (a, a, a + ids_of(12, 30), b, a, a[:128]):
        assert run(warm, ids, params) == run(cold, ids, params), (spec, len(ids))
    first = warm.complete(a, params)
    turn = a + first.token_ids + ids_of(13, 9)  # resumes the prompt's end (a decoded state is not a prefilled one)
    assert run(warm, turn, params) == run(cold, turn, params)
    if spec == "off":  # the prompt's own end (off the grid)
        assert warm.last_cached_tokens == len(a)
    else:  # a speculative request ends before committing its last round; MTP needs hidden rows: grid blocks only
        assert warm.last_cached_tokens >= len(a) // CHUNK * CHUNK


def test_host_tier_spill_and_restore(gpu: Engine) -> None:
    cache = PrefixCache(CHUNK, 3 * MB, 256 * MB, protect_recent=0)
    warm = engine_with(gpu, cache)
    cold = engine_with(gpu, None)
    convs = [ids_of(20 + i, 260) for i in range(4)]
    for ids in convs:
        run(warm, ids, GREEDY)
    info = cache.info()["tiers"]
    assert info["host"]["entries"] > 0 and info["resident"]["bytes"] <= 3 * MB
    for ids in convs:
        assert run(warm, ids + ids_of(30, 10), GREEDY) == run(cold, ids + ids_of(30, 10), GREEDY)
        assert warm.last_cached_tokens >= 256
    assert cache.info()["tiers"]["host"]["bytes"] <= 256 * MB


def test_disk_tier_across_a_restart_on_the_device(gpu: Engine, tmp_path: Path) -> None:
    ids = ids_of(40, 300)
    first = engine_with(gpu, PrefixCache(CHUNK, 256 * MB, 256 * MB, tmp_path, signature="sig"))
    want = run(first, ids, GREEDY)
    again = engine_with(gpu, PrefixCache(CHUNK, 256 * MB, 256 * MB, tmp_path, signature="sig"))
    assert run(again, ids, GREEDY) == want == run(engine_with(gpu, None), ids, GREEDY)
    assert again.last_cached_tokens == 300  # the prompt's end [256, 300), read from disk
    turn = ids + want[0] + ids_of(41, 5)
    assert run(again, turn, GREEDY) == run(engine_with(gpu, None), turn, GREEDY)
    assert again.last_cached_tokens == len(ids)  # the prompt's end, read from disk (no session snapshot)


def test_disk_restore_reads_ahead_and_skips_a_corrupt_file_on_the_device(gpu: Engine, tmp_path: Path) -> None:
    ids = ids_of(50, 400)  # six grid blocks: the reader runs ahead of the uploads through its ring of 3 buffers
    first = PrefixCache(CHUNK, 256 * MB, 256 * MB, tmp_path, signature="sig", background_writes=True)
    want = run(engine_with(gpu, first), ids, GREEDY)
    assert first.wait_writes(60), "the background writer did not finish"
    again = PrefixCache(CHUNK, 256 * MB, 256 * MB, tmp_path, signature="sig")
    assert run(engine_with(gpu, again), ids, GREEDY) == want == run(engine_with(gpu, None), ids, GREEDY)
    assert again.stats.disk_read_blocks >= 6 and again.stats.disk_errors == 0, again.info()
    # a flipped payload byte in the fourth block: the restore stops before it, still exact
    import orjson

    def end_of(p: Path) -> int:
        raw = p.read_bytes()
        return int(orjson.loads(raw[16:16 + int.from_bytes(raw[8:16], "little")])["end"])

    victim = next(p for p in tmp_path.glob("*.tblk") if end_of(p) == 4 * CHUNK)
    raw = bytearray(victim.read_bytes())
    raw[-7] ^= 0x10
    victim.write_bytes(bytes(raw))
    third = PrefixCache(CHUNK, 256 * MB, 256 * MB, tmp_path, signature="sig")
    warm = engine_with(gpu, third)
    assert run(warm, ids, GREEDY) == want, "a restore that skipped a corrupt file differs from the cold run"
    assert third.stats.disk_errors == 1 and warm.last_cached_tokens == 3 * CHUNK, third.info()


@pytest.mark.parametrize("spec", ["off", "mtp"])
def test_warm_up_compiles_without_touching_the_cache(gpu: Engine, spec: str) -> None:
    """``Engine.warm_up`` on the device (what `tandem serve` runs before it listens): it runs, nothing enters or
    is counted in the cache, and the next request equals the cache-off engine's."""
    cache = PrefixCache(CHUNK, 512 * MB, 512 * MB)
    engine = engine_with(gpu, cache, spec)
    assert engine.warm_up() > 0.0
    info = cache.info()
    assert info["hits"] == 0 and info["misses"] == 0 and info["snapshots"] == 0, info
    assert all(t["entries"] == 0 for t in info["tiers"].values()), info
    ids = ids_of(9, 140)
    assert run(engine, ids, GREEDY) == run(engine_with(gpu, None, spec), ids, GREEDY)
