"""The prefix cache is exact: a request served from the cache equals the same request on a fresh engine with the
cache off, tokens and logits bit for bit (issue 36, "Must show"). Sources: tandem/cache/*.py, tandem/engine.py.

States and logits are compared with ``np.array_equal`` on the restored-then-prefilled state against a cold
one-pass prefill; whole requests through their tokens and top-5 logprobs (a function of the logits' bits).
"""

from __future__ import annotations

import dataclasses

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.cache.sequence import SequenceCache
from tandem.cache.store import PrefixCache
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tools.make_checkpoint import write_checkpoint

CHUNK = 64
MB = 1 << 20


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = write_checkpoint(tmp_path_factory.mktemp("cache"), num_hidden_layers=2, full_attention_interval=2,
                            init_std=0.1, seed=11, num_shards=1)
    return Engine.from_pretrained(path, cache="off")


def engine_with(base: Engine, cache: PrefixCache | None, spec: str = "off") -> Engine:
    return Engine(base.model, base.tokenizer, base.chat_template, None, base.eos_token_ids, base.name, spec, cache,
                  CHUNK)


def new_cache(**kw: Any) -> PrefixCache:
    return PrefixCache(CHUNK, kw.pop("resident_bytes", 256 * MB), **kw)


def ids_of(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


def run(engine: Engine, ids: list[int], params: SamplingParams, **kw: Any) -> tuple[Any, ...]:
    c = engine.complete(ids, params, **kw)
    return c.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs], c.finish_reason


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=5)


def cold_state(base: Engine, ids: list[int]) -> tuple[Any, np.ndarray]:
    state = base.model.new_state(len(ids) + 4)
    return state, base.model.prefill(state, ids)


def assert_same_state(a: Any, b: Any) -> None:
    assert a.length == b.length
    for spec in a.specs:
        n = a.length if spec.kind == "view" else None
        assert np.array_equal(a.buffers[spec.name][:n], b.buffers[spec.name][:n]), spec.name


# ------------------------------------------------------------------------------------------------ state level
def test_restored_state_and_logits_equal_a_cold_prefill(base: Engine) -> None:
    cache = new_cache()
    a = ids_of(1, 300)

    def through(ids: list[int]) -> tuple[Any, Any, int]:
        cache.begin("")
        seq = SequenceCache(base.model, cache, CHUNK, "", None)
        state = base.model.new_state(len(ids) + 4)
        logits = seq.prefill(state, ids)
        cache.end()
        return state, logits, seq.cached_tokens

    through(a)
    b = a[:150] + ids_of(2, 100)  # a branch off a's prefix
    # every prefill also leaves a restore point at its prompt's end (off the grid: 300, then 63, 65, 129, ...), so
    # a retry is a whole hit and a prompt that extends an earlier one resumes where that one ended
    cases = [(a, 300), (a[:63], 0), (a[:64], 64), (a[:65], 64), (a[:127], 65), (a[:128], 128), (a[:129], 128),
             (a + ids_of(3, 40), 300), (b, 129), (a[:256], 256)]
    for ids, expect in cases:
        state, logits, cached = through(ids)
        ref_state, ref_logits = cold_state(base, ids)
        assert cached == expect, (len(ids), cached)
        assert np.array_equal(logits, ref_logits), len(ids)
        assert_same_state(state, ref_state)
    state, logits, cached = through(b + ids_of(4, 10))  # b's own blocks were published by its prefill
    assert cached == 250
    ref_state, ref_logits = cold_state(base, b + ids_of(4, 10))
    assert np.array_equal(logits, ref_logits)
    assert_same_state(state, ref_state)


# ------------------------------------------------------------------------------------------------ requests
@pytest.mark.parametrize("spec", ["off", "lookup", "mtp", "auto"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_requests_equal_cache_off(base: Engine, spec: str, params: SamplingParams) -> None:
    cold = engine_with(base, None, spec)
    warm = engine_with(base, new_cache(), spec)
    a = ids_of(10, 140) * 2  # repeats, so lookup drafts
    b = a[:200] + ids_of(11, 70)
    # a prompt's end is a restore point too (280: a resend is a whole hit, an extension resumes there)
    for ids, cached in [(a, 0), (a, 280), (a + ids_of(12, 30), 280), (b, 192), (a, 280), (a[:128], 128)]:
        assert run(warm, ids, params) == run(cold, ids, params), (spec, len(ids))
        assert warm.last_cached_tokens == cached, (spec, len(ids))


def test_hits_after_speculative_rounds_and_across_engines(base: Engine) -> None:
    cache = new_cache()
    a = ids_of(20, 100) * 3
    spec_engine = engine_with(base, cache, "lookup")
    plain = engine_with(base, cache, "off")
    assert run(spec_engine, a, GREEDY) == run(engine_with(base, None), a, GREEDY)
    longer = a + ids_of(21, 50)
    assert run(plain, longer, GREEDY) == run(engine_with(base, None), longer, GREEDY)
    assert plain.last_cached_tokens == 300  # the speculative request's prompt end


def test_disconnect_mid_prefill_publishes_completed_snapshots_only(base: Engine) -> None:
    cache = new_cache()
    warm = engine_with(base, cache)
    ids = ids_of(30, 400)
    polls = iter([False, False, True])
    chunks = list(warm.generate(ids, GREEDY, cancelled=lambda: next(polls, True)))
    assert chunks[-1].finish_reason == "abort" and not chunks[-1].token_ids
    assert cache.info()["tiers"]["resident"]["entries"] == 2  # [0, 64) and [64, 128) were completed
    assert run(warm, ids, GREEDY) == run(engine_with(base, None), ids, GREEDY)
    assert warm.last_cached_tokens == 128


def test_disconnect_mid_decode_and_generator_closed(base: Engine) -> None:
    cache = new_cache()
    warm = engine_with(base, cache)
    ids = ids_of(31, 200)
    gen = warm.generate(ids, GREEDY)
    next(gen)
    gen.close()  # the client went away between rounds
    n = [0]

    def cancel() -> bool:
        n[0] += 1
        return n[0] > 3

    assert list(warm.generate(ids, GREEDY, cancelled=cancel))[-1].finish_reason == "abort"
    assert run(warm, ids, GREEDY) == run(engine_with(base, None), ids, GREEDY)
    assert warm.last_cached_tokens == 200  # the prompt's end, published when its prefill completed


class Failing:
    """The adapter, failing on its ``fail_at``-th call of ``verb``."""

    def __init__(self, model: Any, verb: str, fail_at: int) -> None:
        self._model, self.verb, self.fail_at, self.calls = model, verb, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if name != self.verb:
            return attr

        def wrapped(*a: Any, **kw: Any) -> Any:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError("injected failure")
            return attr(*a, **kw)
        return wrapped


@pytest.mark.parametrize("verb,fail_at,cached", [("prefill", 3, 128), ("decode", 4, 210)])
def test_hit_after_an_exception(base: Engine, verb: str, fail_at: int, cached: int) -> None:
    cache = new_cache()
    broken = Engine(Failing(base.model, verb, fail_at), None, None, None, (), "m", "off", cache, CHUNK)
    ids = ids_of(40, 210)
    with pytest.raises(RuntimeError, match="injected"):
        broken.complete(ids, GREEDY)
    warm = engine_with(base, cache)
    assert run(warm, ids, GREEDY) == run(engine_with(base, None), ids, GREEDY)
    assert warm.last_cached_tokens == cached


def test_salts_do_not_share_entries(base: Engine) -> None:
    warm = engine_with(base, new_cache())
    ids = ids_of(50, 150)
    run(warm, ids, GREEDY, cache_salt="alice")
    run(warm, ids, GREEDY, cache_salt="bob")
    assert warm.last_cached_tokens == 0
    run(warm, ids, GREEDY, cache_salt="alice")
    assert warm.last_cached_tokens == 150


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_distinct_salts_give_their_memory_back(base: Engine) -> None:
    """Requests under distinct cache_salts each keep their snapshots (within the budget); evicting them leaves no
    per-salt root behind, and clearing the cache (DELETE /v1/cache) hands the freed pages back to the system."""
    cache = new_cache(protect_recent=0)
    warm = engine_with(base, cache)
    ids = ids_of(52, 40)  # shorter than a grid block: each request keeps small (malloc-arena) snapshots only
    run(warm, ids, GREEDY, cache_salt="warm-up")
    cache.clear()
    before = _resident_bytes()
    pins = []  # small objects that outlive the snapshots between them, as a server's own allocations do
    for i in range(300):
        run(warm, ids, SamplingParams(max_tokens=1), cache_salt=f"salt-{i}")
        pins.append(bytearray(64))
    held = cache.info()["tiers"]["resident"]["bytes"]
    assert held > 0 and len(cache.index.roots) == 300
    grown = _resident_bytes() - before
    assert cache.clear() > 0 and cache.index.roots == {}
    # the snapshots held ~5 MB; the resident set grew 3.0-3.5 MB in CI runs (freed pages reused): more than twice what
    # may stay after the clear
    assert grown > 2 * MB and _resident_bytes() - before < MB // 2, (grown, held)
    for i in range(3):  # eviction prunes the salt's root too
        run(warm, ids, SamplingParams(max_tokens=1), cache_salt=f"again-{i}")
    for block in list(cache.index.blocks):
        cache.index.remove(block)
    assert cache.index.roots == {}


# ------------------------------------------------------------------------------------------------ budgets
def block_bytes(base: Engine) -> int:
    probe = new_cache()
    run(engine_with(base, probe), ids_of(60, 64), SamplingParams(max_tokens=1))
    return int(probe.info()["tiers"]["resident"]["bytes"])


def test_a_full_cache_degrades_to_a_miss(base: Engine) -> None:
    cache = PrefixCache(CHUNK, block_bytes(base) - 1)
    warm = engine_with(base, cache)
    ids = ids_of(61, 150)
    for _ in range(2):
        assert run(warm, ids, GREEDY) == run(engine_with(base, None), ids, GREEDY)
        assert warm.last_cached_tokens == 0
    assert cache.info()["refused"] >= 2 and cache.info()["tiers"]["resident"]["bytes"] == 0


def test_evictions_without_a_disk_tier_free_their_bytes(base: Engine) -> None:
    """A block dropped from memory (no tier below it) gives its bytes back: the budget does not fill with blocks
    that are gone, and the next conversation is cached in their place."""
    one = block_bytes(base)
    cache = PrefixCache(CHUNK, 2 * one, protect_recent=0)
    warm = engine_with(base, cache)
    run(warm, ids_of(76, 130), GREEDY)  # its 2 grid blocks fill the cache
    other = ids_of(77, 130)
    for _ in range(2):
        assert run(warm, other, GREEDY) == run(engine_with(base, None), other, GREEDY)
    tier = cache.info()["tiers"]["resident"]
    assert tier["evictions"] >= 1 and tier["bytes"] == tier["entries"] * one == 2 * one, tier
    assert warm.last_cached_tokens == 128


def test_recent_conversations_survive_an_unrelated_request(base: Engine) -> None:
    one = block_bytes(base)
    cache = PrefixCache(CHUNK, 4 * one, protect_recent=1)
    warm = engine_with(base, cache)
    conv = ids_of(70, 200)  # 3 blocks
    run(warm, conv, GREEDY)
    run(warm, ids_of(71, 130), GREEDY)  # 2 blocks: room for 1 beside the conversation, none evicted
    run(warm, conv + ids_of(72, 20), GREEDY)
    assert warm.last_cached_tokens == 192


def test_requests_that_publish_nothing_still_age_the_protected_ones(base: Engine) -> None:
    """A request whose snapshots are all refused still counts among the recent ones, so the conversation it
    follows is no longer protected and later requests can evict it (else a full cache keeps it for good)."""
    one = block_bytes(base)
    cache = PrefixCache(CHUNK, 2 * one, protect_recent=1)
    warm = engine_with(base, cache)
    run(warm, ids_of(74, 130), GREEDY)  # its 2 grid blocks fill the cache
    other = ids_of(75, 130)
    for _ in range(3):
        assert run(warm, other, GREEDY) == run(engine_with(base, None), other, GREEDY)
    assert warm.last_cached_tokens == 128, cache.info()
    assert cache.info()["tiers"]["resident"]["evictions"] >= 1


def test_memory_stays_within_budgets_over_200_requests(base: Engine, tmp_path: Path) -> None:
    one = block_bytes(base)
    cache = PrefixCache(CHUNK, 5 * one, cache_dir=tmp_path / "c", disk_bytes=12 * one + (12 << 16),
                        signature="sig", protect_recent=2)
    warm = engine_with(base, cache)
    rng = np.random.default_rng(80)
    stems = [ids_of(81 + i, 130) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ends = {0, 64, 128, 192}  # where a restore can land: the grid, an earlier prompt's end, an earlier session's end
    for r in range(200):
        ids = stems[int(rng.integers(0, 6))] + rng.integers(0, 512, int(rng.integers(1, 90))).tolist()
        warm.complete(ids, params)
        info = cache.info()["tiers"]
        assert info["resident"]["bytes"] <= 5 * one
        assert info["disk"]["bytes"] <= 12 * one + (12 << 16)
        assert sum(f.stat().st_size for f in (tmp_path / "c").iterdir()) == info["disk"]["bytes"]
        assert warm.last_cached_tokens in ends, (r, warm.last_cached_tokens)
        ends |= {len(ids), len(ids) + 1}
    s = cache.info()
    assert s["hits"] > 100 and s["tiers"]["resident"]["evictions"] > 0
    assert s["reused_tokens"] > 0 and s["misses"] + s["hits"] == 200


# ------------------------------------------------------------------------------------------------ disk tier
def test_disk_tier_across_a_restart(base: Engine, tmp_path: Path) -> None:
    ids = ids_of(90, 300)
    first = engine_with(base, new_cache(cache_dir=tmp_path, signature="sig"))
    want = run(first, ids, GREEDY)  # 4 grid blocks, the prompt's end [256, 300) and the session block [256, 311)
    assert sorted(p.stat().st_mode & 0o777 for p in tmp_path.iterdir()) == [0o600] * 6
    again = engine_with(base, new_cache(cache_dir=tmp_path, signature="sig"))  # a new process's cache
    assert again.cache is not None and again.cache.info()["tiers"]["disk"]["entries"] == 6
    assert run(again, ids, GREEDY) == want == run(engine_with(base, None), ids, GREEDY)
    assert again.last_cached_tokens == 300  # the prompt's end, read from disk
    longer = ids + ids_of(91, 30)
    assert run(again, longer, GREEDY) == run(engine_with(base, None), longer, GREEDY)


def test_resident_evictions_spill_to_disk(base: Engine, tmp_path: Path) -> None:
    one = block_bytes(base)
    cache = PrefixCache(CHUNK, 3 * one, cache_dir=tmp_path, signature="sig", protect_recent=0)
    warm = engine_with(base, cache)
    a, b = ids_of(100, 200), ids_of(101, 200)
    run(warm, a, GREEDY)
    run(warm, b, GREEDY)  # evicts a's blocks from memory: they stay on disk
    assert cache.info()["tiers"]["resident"]["evictions"] >= 3
    assert run(warm, a, GREEDY) == run(engine_with(base, None), a, GREEDY)
    assert warm.last_cached_tokens == 192


def test_corrupt_truncated_and_foreign_files_never_load(base: Engine, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    ids = ids_of(110, 200)
    run(engine_with(base, new_cache(cache_dir=tmp_path, signature="sig")), ids, GREEDY)
    files = sorted(tmp_path.glob("*.tblk"), key=lambda p: p.stat().st_size)
    assert len(files) == 5  # 3 grid blocks, the prompt's end [192, 200) and the session block [192, 211)
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / "junk.tblk").write_bytes(b"garbage")
    run(engine_with(base, new_cache(cache_dir=tmp_path / "other", signature="other-model")), ids_of(111, 70),
        GREEDY)
    foreign = next((tmp_path / "other").glob("*.tblk"))
    foreign.rename(tmp_path / foreign.name)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        cache = new_cache(cache_dir=tmp_path, signature="sig")
    assert not (tmp_path / "junk.tblk").exists() and not (tmp_path / foreign.name).exists()
    assert (tmp_path / "notes.txt").exists() and cache.info()["tiers"]["disk"]["entries"] == 5
    assert sum("ignoring" in r.message for r in caplog.records) == 2
    # flip one payload byte of the second block and cut the third short: only the first loads
    by_end = {int(__import__("orjson").loads(p.read_bytes()[16:16 + int.from_bytes(p.read_bytes()[8:16], "little")])
                  ["end"]): p for p in files}
    raw = bytearray(by_end[128].read_bytes())
    raw[-5] ^= 0xFF
    by_end[128].write_bytes(bytes(raw))
    warm = engine_with(base, cache)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert run(warm, ids, GREEDY) == run(engine_with(base, None), ids, GREEDY)
    assert warm.last_cached_tokens == 64
    assert by_end[128].read_bytes() != bytes(raw)  # removed, then written whole again by this request
    by_end[64].write_bytes(by_end[64].read_bytes()[:-3])
    assert new_cache(cache_dir=tmp_path, signature="sig").info()["tiers"]["disk"]["entries"] == 0
    assert not by_end[64].exists()


def test_a_file_whose_arrays_disagree_with_the_state_is_ignored(base: Engine, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A file whose header and CRC are whole but whose array table does not fit the state (a reshaped array, a
    renamed one) is ignored with one warning and removed; the request is served from the blocks before it."""
    import orjson

    views = {spec.name for spec in base.model.new_state(1).specs if spec.kind == "view"}
    ids = ids_of(112, 200)
    want = run(engine_with(base, new_cache(cache_dir=tmp_path, signature="sig")), ids, GREEDY)
    for edit in ("reshape", "rename"):
        by_end = {}
        for p in tmp_path.glob("*.tblk"):
            raw = p.read_bytes()
            n = int.from_bytes(raw[8:16], "little")
            by_end[int(orjson.loads(raw[16:16 + n])["end"])] = p
        path = by_end[128]
        raw = path.read_bytes()
        n = int.from_bytes(raw[8:16], "little")
        head = orjson.loads(raw[16:16 + n])
        entry = next(a for a in head["arrays"] if a[0] in views)  # a view: every block's rows are copied
        if edit == "reshape":
            entry[2] = [entry[2][0] // 2, entry[2][1] * 2, *entry[2][2:]]
        else:
            entry[0] = "not." + entry[0]
        new_head = orjson.dumps(head)
        path.write_bytes(raw[:8] + len(new_head).to_bytes(8, "little") + new_head + raw[16 + n:])
        caplog.clear()
        warm = engine_with(base, new_cache(cache_dir=tmp_path, signature="sig"))
        with caplog.at_level(logging.WARNING, logger="tandem.cache"):
            assert run(warm, ids, GREEDY) == want, edit
        assert warm.last_cached_tokens == 64, edit
        assert sum("ignoring" in r.message for r in caplog.records) == 1, edit


def test_clear_drops_every_tier(base: Engine, tmp_path: Path) -> None:
    cache = new_cache(cache_dir=tmp_path, signature="sig")
    run(engine_with(base, cache), ids_of(120, 200), GREEDY)
    assert cache.clear() == 5  # 3 grid blocks, the prompt's end and the session block
    info = cache.info()
    assert all(t["entries"] == 0 and t["bytes"] == 0 for t in info["tiers"].values())
    assert not list(tmp_path.glob("*.tblk"))


def test_session_blocks_of_generated_tokens_are_exact(base: Engine) -> None:
    warm = engine_with(base, new_cache())
    cold = engine_with(base, None)
    ids = ids_of(130, 200)
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    out = warm.complete(ids, long).token_ids  # 279 tokens in the state: the session snapshot as decode left it
    turn = ids + out + ids_of(131, 20)
    assert warm.cache is not None
    state = base.model.new_state(len(turn))
    assert warm.cache.restore("", turn, state).length == 279
    assert_same_state(state, cold_state(base, turn[:279])[0])  # the session snapshot == a cold prefill, bitwise
    assert run(warm, turn, GREEDY) == run(cold, turn, GREEDY)
    assert warm.last_cached_tokens == 279


# ------------------------------------------------------------------------------------------------ chat template
def test_real_template_dropping_reasoning_diverges_in_the_last_assistant_turn() -> None:
    """The embedded model's Qwen3.5 template renders an earlier assistant turn without its think block, so turn 2's
    ids leave turn 1's inside the generation prompt: the grid blocks before it are what turn 2 reuses."""
    warm = Engine.from_pretrained(cache="on", prefix_chunk=CHUNK)
    cold = Engine(warm.model, warm.tokenizer, warm.chat_template, None, warm.eos_token_ids, warm.name)
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "looks things up " * 8,
                                               "parameters": {"type": "object", "properties": {
                                                   "query": {"type": "string"}}}}} for i in range(3)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant. " * 12},
                                      {"role": "user", "content": "Explain what a cache is, briefly."}]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    first = warm.complete(messages, params, tools=tools)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a prefix cache?"}]
    ids2 = warm.encode_prompt(messages, tools)
    common = next(i for i, (x, y) in enumerate(zip(first.prompt_ids, ids2)) if x != y)
    assert len(first.prompt_ids) - 4 <= common < len(first.prompt_ids)  # inside the generation prompt
    assert common >= 2 * CHUNK
    second = warm.complete(ids2, params)
    assert warm.last_cached_tokens == common // CHUNK * CHUNK
    ref = cold.complete(ids2, params)
    assert second.token_ids == ref.token_ids
    assert [(lp.token_id, lp.logprob, lp.top) for lp in second.logprobs] == \
        [(lp.token_id, lp.logprob, lp.top) for lp in ref.logprobs]


# ------------------------------------------------------------------------------------------------ session snapshots
def test_session_snapshots_off_the_grid_for_a_model_whose_prefill_is_decode() -> None:
    """The bookkeeping of the CUDA model's session snapshots, on tests/toy_arch.py's model (its prefill writes what
    its decode writes), flagged ``prefill_matches_decode``: rows-only grid blocks, then a partial restore point."""
    from toy_arch import ToyHParams, ToyModel

    class Toy(ToyModel):
        capabilities = dataclasses.replace(ToyModel.capabilities, prefill_matches_decode=True)

    model = Toy(ToyHParams(vocab_size=97, max_position_embeddings=1024, eos_token_ids=(), step=3))
    cache = new_cache()
    warm = Engine(model, None, None, None, (), "toy", "off", cache, CHUNK)
    cold = Engine(model, None, None, None, (), "toy", "off", None, CHUNK)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    prompt = ids_of(140, 100)
    prompt = [t % 97 for t in prompt]
    out = warm.complete(prompt, params).token_ids
    # [0, 64) and the prompt's end [64, 100) from prefill; the session's 64, 128 rows and [192, 199)
    assert cache.info()["tiers"]["resident"]["entries"] == 5
    turn = prompt + out + [5, 6, 7]
    assert warm.complete(turn, params).token_ids == cold.complete(turn, params).token_ids
    assert warm.last_cached_tokens == 199
    state = model.new_state(400)
    assert cache.restore("", turn, state).length == len(turn)  # the turn's own prompt end, past the session's
    assert state.buffers["tokens"][:len(turn)].tolist() == turn
    # leaves the session inside [128, 192): the rows-only blocks cannot restore, and the walk follows the full
    # block [64, 128) past the prompt's end [64, 100) (a partial block beside it), so [0, 64) is the restore point
    branch = prompt + out[:50] + [1, 2]
    assert warm.complete(branch, params).token_ids == cold.complete(branch, params).token_ids
    assert warm.last_cached_tokens == 64


def test_generate_cli_reuses_a_prefix_across_invocations(base: Engine, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import orjson

    from tandem.cli import main

    assert base.model.path is not None
    ids = ",".join(str(t) for t in ids_of(150, 150))
    argv = ["generate", str(base.model.path), "--prompt-ids", ids, "--max-tokens", "4", "--device", "cpu",
            "--json", "--cache-dir", str(tmp_path / "c"), "--prefix-chunk", "64"]
    outs = []
    for _ in range(2):
        assert main(argv) == 0
        outs.append(orjson.loads(capsys.readouterr().out))
    assert [o["cached_tokens"] for o in outs] == [0, 150]  # the prompt's end
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700


def test_generate_cli_returns_once_its_cache_files_are_written(base: Engine, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``main(["generate", ...])`` returns after the disk tier's files are written, so a script's next
    invocation in the same process (or right after) finds them: here on a disk slowed to 0.3 s a file."""
    import json
    import time

    from tandem.cache import disk
    from tandem.cli import main

    write = disk.write_block

    def slow_write(*args: Any, **kwargs: Any) -> int:
        time.sleep(0.3)
        return write(*args, **kwargs)

    monkeypatch.setattr(disk, "write_block", slow_write)
    assert base.model.path is not None
    ids = ",".join(str(t) for t in ids_of(151, 150))
    argv = ["generate", str(base.model.path), "--prompt-ids", ids, "--max-tokens", "4", "--device", "cpu",
            "--cache-dir", str(tmp_path / "c"), "--prefix-chunk", "64"]
    assert main(argv) == 0
    # 2 grid blocks, the prompt's end [128, 150) and the session block [128, 153)
    assert len(list((tmp_path / "c").glob("*.tblk"))) == 4
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["cached_tokens"] == 150


def test_warm_up_bypasses_the_cache(base: Engine) -> None:
    """``Engine.warm_up`` runs requests with the cache bypassed: nothing looked up, published or counted, and the
    next request equals a fresh engine's. A host model has nothing to compile (0.0); a device model (one that
    declares ``synchronize``; here the host model declaring it, and reusing its states as the CUDA model does) runs
    the warm-up requests."""
    cache = new_cache()
    engine = engine_with(base, cache)
    assert engine.warm_up() == 0.0
    caps = base.model.capabilities
    engine.model = _Reusing(base.model, dataclasses.replace(caps, reuses_states=True, synchronize=True))  # type: ignore[assignment]
    spent = engine.warm_up()
    assert spent > 0.0
    info = cache.info()
    assert info["hits"] == 0 and info["misses"] == 0 and info["snapshots"] == 0, info
    assert all(t["entries"] == 0 for t in info["tiers"].values()), info
    assert engine.last_cached_tokens == 0 and engine._spare_state is not None
    ids = ids_of(5, 150)
    assert run(engine, ids, GREEDY) == run(engine_with(base, None), ids, GREEDY)


class _Reusing:
    """A model seen through other capabilities (every other attribute is the wrapped model's)."""

    def __init__(self, model: Any, capabilities: Any) -> None:
        self._model, self.capabilities = model, capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_prompt_end_snapshots_on_the_model_grid(base: Engine) -> None:
    """A model chunk-invariant only at multiples of 64 (``Capabilities.prefill_grid``, the GPU's chunked GDN scan)
    keeps a prompt's end snapshot at the last multiple of 64 before the end: the last piece is cut there, and a
    retry restores it and prefills the rest. Here on the NumPy model declared so (its own bits are any cut's)."""

    class Grid:
        def __init__(self, model: Any) -> None:
            self._model, self.pieces = model, []
            self.capabilities = dataclasses.replace(model.capabilities, prefill_matches_decode=False,
                                                    prefill_chunk_invariant=True, prefill_grid=64)

        def prefill(self, state: Any, ids: Any, **kw: Any) -> Any:
            self.pieces.append(len(ids))
            return self._model.prefill(state, ids, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._model, name)

    model = Grid(base.model)
    cache = PrefixCache(256, 256 * MB)
    a = ids_of(9, 300)
    # (prompt, tokens restored, pieces prefilled): 200 ends at 192 + 8; 300 resumes at 192, then the grid's 256
    cases = [(a[:200], 0, [192, 8]), (a[:200], 192, [8]), (a, 192, [64, 44]), (a, 256, [44]), (a[:202], 192, [10])]
    for ids, expect, pieces in cases:
        cache.begin("")
        seq = SequenceCache(model, cache, 256, "", None)
        state = base.model.new_state(len(ids) + 4)
        model.pieces = []
        logits = seq.prefill(state, ids)
        cache.end()
        assert (seq.cached_tokens, model.pieces) == (expect, pieces), len(ids)
        ref_state, ref_logits = cold_state(base, ids)
        assert np.array_equal(logits, ref_logits), len(ids)
        assert_same_state(state, ref_state)
