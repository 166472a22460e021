"""Sequence slots (tandem/slots.py, ``Engine(parallel=N)``): requests run at once, and each request's tokens,
logprobs and finish reason are bit-identical alone or beside others, at any N and arrival order, greedy and seeded,
with speculation off / lookup / MTP / auto and the prefix cache on or off (batch invariance)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tandem.slots import FairLock, SlotPool, Slot

# Four prompts of different lengths; the repeated ones give the lookup drafter something to draft.
PROMPTS = [
    [5, 9, 13, 7, 5, 9, 13, 7, 5, 9, 13, 7, 5, 9],
    [int(t) for t in range(40, 140)],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 6,
    [17, 2],
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, ignore_eos=True, seed=7, logprobs=1),
    SamplingParams(temperature=0.7, top_k=20, max_tokens=16, seed=123, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["x"]),
]
MIXES = [(0, 1), (2, 1, 0), (0, 1, 2, 3), (3, 3, 2, 2)]


def _result(engine: Engine, i: int) -> tuple[list[int], list[tuple[int, float, object]], str]:
    done = engine.complete(PROMPTS[i], PARAMS[i])
    return done.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in done.logprobs], done.finish_reason


def _together(engine: Engine, mix: tuple[int, ...], stagger_s: float = 0.0
              ) -> tuple[list[tuple[list[int], list[tuple[int, float, object]], str]], list[tuple[float, float]]]:
    """Run the mix's requests from one thread each, started together (or ``stagger_s`` apart); their results and
    (first chunk, last chunk) times."""
    results: list[object] = [None] * len(mix)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(mix)
    start = threading.Barrier(len(mix))

    def run(j: int) -> None:
        start.wait()
        time.sleep(j * stagger_s)
        i = mix[j]
        ids: list[int] = []
        lps: list[tuple[int, float, object]] = []
        finish = ""
        first = None
        for chunk in engine.generate(PROMPTS[i], PARAMS[i]):
            first = first if first is not None else time.perf_counter()
            ids += chunk.token_ids
            lps += [(lp.token_id, lp.logprob, lp.top) for lp in chunk.logprobs]
            finish = chunk.finish_reason or finish
        results[j] = (ids, lps, finish)
        spans[j] = (first or 0.0, time.perf_counter())

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(mix))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results), "a request did not finish"
    return results, spans  # type: ignore[return-value]


@pytest.mark.parametrize("spec,cache,joint", [("off", "off", False), ("off", "on", False), ("lookup", "on", False),
                                              ("mtp", "off", False), ("auto", "on", False), ("off", "off", True),
                                              ("mtp", "on", True), ("auto", "off", True)])
def test_tokens_alone_equal_tokens_beside_others(tiny_ckpt: Path, spec: str, cache: str, joint: bool) -> None:
    alone = Engine.from_pretrained(tiny_ckpt, spec=spec, cache=cache, max_context=512)
    expected = [_result(alone, i) for i in range(len(PROMPTS))]
    engine = Engine.from_pretrained(tiny_ckpt, spec=spec, cache=cache, max_context=512, parallel=3,
                                    joint_rounds=joint)
    engine.spec_max_running = 3  # trees in the joint passes too (by default a slot beside others takes plain steps)
    assert engine.parallel == 3 and (engine.rounds is not None) == joint
    for k, mix in enumerate(MIXES):
        results, _ = _together(engine, mix, stagger_s=0.002 * (k % 2))
        for j, i in enumerate(mix):
            assert results[j] == expected[i], f"mix {mix}: request {i} differs beside the others"
    # and alone again on the parallel engine (its slots hold the others' history): the same bits
    for i in range(len(PROMPTS)):
        assert _result(engine, i) == expected[i]
    if engine.rounds is not None:  # the rounds were gathered: passes carried several slots' items
        assert engine.rounds.items > engine.rounds.passes


def test_slots_beside_others_draft_no_trees_by_default(tiny_ckpt: Path) -> None:
    """Engine.spec_max_running (default 1): a slot's tree may hold 32 / running nodes while at most that many slots
    are in their rounds, else one node (a plain step) and its drafters are not asked."""
    engine = Engine.from_pretrained(tiny_ckpt, spec="lookup", cache="off", max_context=512, parallel=3,
                                    joint_rounds=True)
    assert engine.spec_max_running == 1 and engine.rounds is not None
    spec = engine._make_slot(0).speculator
    assert spec is not None and spec.node_cap is not None
    asked: list[int] = []
    spec.drafters = [type("Drafter", (), {"propose": lambda self, *a: asked.append(1)})()]  # type: ignore[assignment]
    engine.rounds._active = {0: 1}
    assert spec.node_cap() == 32
    engine.rounds._active = {0: 1, 1: 2}
    assert spec.node_cap() == 1
    assert len(spec.draft(7, 10)) == 1 and not asked  # no drafter asked
    engine.spec_max_running = 3
    engine.rounds._active = {0: 1, 1: 2, 2: 3}
    assert spec.node_cap() == 10
    engine.rounds._active = {}


def test_requests_run_at_once_and_a_slot_is_waited_for(tiny_ckpt: Path) -> None:
    engine = Engine.from_pretrained(tiny_ckpt, cache="off", max_context=512, parallel=2)
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    results: dict[str, tuple[float, float]] = {}
    held = threading.Event()

    def run(name: str, prompt: list[int], params: SamplingParams) -> None:
        first = None
        for _ in engine.generate(prompt, params):
            first = first if first is not None else time.perf_counter()
            held.set()
        results[name] = (first or 0.0, time.perf_counter())

    a = threading.Thread(target=run, args=("long", PROMPTS[1], long))
    a.start()
    assert held.wait(60)
    b = threading.Thread(target=run, args=("short", PROMPTS[3], SamplingParams(max_tokens=4, ignore_eos=True)))
    b.start()
    b.join(120)
    a.join(120)
    # the short request came after the long one had started and finished before it: it did not wait for it
    assert results["short"][1] < results["long"][1]
    assert engine.slots.running == 0
    # a third request waits while both slots are held
    pool = engine.slots
    s0, s1 = pool.acquire(), pool.acquire()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout_s=0.05)
    pool.release(s1)
    assert pool.acquire(timeout_s=1.0).index == s1.index
    pool.release(s0)


def test_an_abandoned_generator_frees_its_slot(tiny_ckpt: Path) -> None:
    engine = Engine.from_pretrained(tiny_ckpt, cache="off", max_context=512, parallel=2)
    gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    next(gen)
    assert engine.slots.running == 1
    gen.close()
    assert engine.slots.running == 0


def test_cancelled_request_frees_its_slot_at_the_next_round(tiny_ckpt: Path) -> None:
    engine = Engine.from_pretrained(tiny_ckpt, cache="off", max_context=512, parallel=2)
    stop = threading.Event()
    chunks = list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True),
                                  cancelled=lambda: stop.is_set() or bool(stop.set())))
    assert chunks[-1].finish_reason == "abort"
    assert engine.slots.running == 0


class _DeadEnd:
    """A constraint that allows every token for ``steps`` positions, then none (the request fails mid-way)."""

    def __init__(self, vocab: int, steps: int) -> None:
        self.vocab, self.steps = vocab, steps

    def allowed(self) -> np.ndarray | None:
        return np.ones(self.vocab, bool) if self.steps > 0 else np.zeros(self.vocab, bool)

    def advance(self, token_id: int) -> None:
        self.steps -= 1


@pytest.mark.parametrize("joint", [False, True])
def test_a_failing_request_does_not_disturb_the_others(tiny_ckpt: Path, joint: bool) -> None:
    alone = Engine.from_pretrained(tiny_ckpt, cache="off", max_context=512)
    want = _result(alone, 1)
    engine = Engine.from_pretrained(tiny_ckpt, cache="off", max_context=512, parallel=2, joint_rounds=joint)
    errors: list[BaseException] = []
    got: list[object] = []
    go = threading.Barrier(2)

    def failing() -> None:
        go.wait()
        try:
            list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True),
                                 constraint=_DeadEnd(engine.vocab_size, 5)))
        except ValueError as exc:
            errors.append(exc)

    def healthy() -> None:
        go.wait()
        got.append(_result(engine, 1))

    threads = [threading.Thread(target=failing), threading.Thread(target=healthy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(errors) == 1 and "masked" in str(errors[0])
    assert got == [want]
    assert engine.slots.running == 0


def test_parallel_must_be_a_positive_integer(tiny_ckpt: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="parallel"):
            Engine.from_pretrained(tiny_ckpt, parallel=bad)  # type: ignore[arg-type]


def test_fair_lock_serves_in_arrival_order_and_is_reentrant() -> None:
    lock = FairLock()
    order: list[int] = []
    lock.acquire()
    lock.acquire()  # re-entrant
    lock.release()
    threads = []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 5
        while len(lock._queue) < i + 1 and time.monotonic() < deadline:  # queued before the next one comes
            time.sleep(0.001)
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        lock.release()


def test_slot_pool_builds_each_slot_once() -> None:
    built: list[int] = []

    def make(i: int) -> Slot:
        built.append(i)
        return Slot(i, None, None)

    pool = SlotPool(3, make)
    a = pool.acquire()
    pool.release(a)
    b = pool.acquire()
    assert a is b and built == [0]
    c = pool.acquire()
    assert c.index == 1 and built == [0, 1]
    pool.release(b)
    pool.release(c)
    assert pool.running == 0 and [s.index for s in pool.built()] == [0, 1]
