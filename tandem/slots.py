"""Sequence slots: several requests at once over one copy of the weights (``Engine(parallel=N)``, ``--parallel``).

A slot is what one running request holds: its own sequence state (KV rows and recurrent state; on a device model
allocated once for the context and reused, with its recorded launch plans), its own speculator (drafters, acceptance
estimates, verify scratch) and the model as the slot sees it (``SlotModel``). ``SlotPool`` hands slots out; a caller
past the last free slot waits for one.

Every call that runs the model for a slot (prefill pieces, decode steps, verify passes, commits, the MTP head's
drafts, device sampling) holds ``FairLock``, a first-come first-served lock, for that call only. The slots' calls
therefore interleave: while one slot prefills a long prompt piece by piece, another slot's decode steps run between
its pieces (the stall a round suffers is at most one prefill piece: the cache grid, 1,024 tokens on a GPU), and no
slot waits for another's whole request.

The joint round (``JointRounds``, for a model that declares ``Capabilities.joint_rounds``: the CUDA Qwen3.5 dense
model): the slots' decode steps and verify passes are gathered into one forward pass (``joint_forward``), so a
weight is read once for every running slot's rows. A slot that calls ``decode`` or ``verify_tree`` waits until every
other running slot has called one too (or ``gather_s`` has passed: a slot busy elsewhere is not waited for longer),
and the last to come runs the pass for all of them under the lock; prefill pieces, commits and drafts run between
passes as before.

Batch invariance: each call computes with the slot's own state and buffers only, through kernels whose rows do not
depend on the other rows (the row-invariant GEMVs of the joint pass; otherwise the very kernels a lone request
runs), so nothing a slot computes depends on what other slots are doing or on the order in which calls were
served: a request's tokens, logprobs and usage are bit-identical alone or beside others, at any ``parallel`` and
any arrival order (tests/test_slots.py, tests/test_cuda_joint.py). The model's shared working buffers (the
tensor-core prefill's, the layer ops' operand buffers) are only ever touched under the lock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tandem.models.protocol import JointItem, run_items_alone

# The verbs and draft-head methods that run the model: each runs under the slots' lock.
_LOCKED = frozenset({"prefill", "decode", "verify_tree", "commit", "choose_on_device", "new_state", "new_tree_scratch",
                     "forward", "top_probs", "chain", "joint_forward"})


class FairLock:
    """A re-entrant lock served in arrival order (``threading.Lock`` is not fair: a thread that releases and at once
    re-acquires, as a prefill going piece by piece does, could keep the others out for the whole prompt).

    ``acquire`` blocks until every earlier caller has had its turn; the owning thread may acquire again (re-entrant).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[int] = collections.deque()  # waiting tickets, in arrival order
        self._next = 0
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        """Take the lock in turn (re-entrant for its owner)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            ticket = self._next
            self._next += 1
            self._queue.append(ticket)
            while self._owner is not None or self._queue[0] != ticket:
                self._cond.wait()
            self._queue.popleft()
            self._owner, self._depth = me, 1

    def release(self) -> None:
        """Give the lock to the next caller in line. Raises: RuntimeError when this thread does not hold it."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock.release by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Locked:
    """An object whose model-running methods (``_LOCKED``) hold ``lock`` while they run; everything else passes
    through. Results that run the model again (a draft head from ``draft_heads``) are wrapped the same way."""

    def __init__(self, target: Any, lock: FairLock) -> None:
        self._target = target
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name in _LOCKED and callable(value):
            return _locked_call(value, self._lock)
        if name == "draft_heads" and callable(value):
            def heads() -> Any:
                with self._lock:
                    head = value()
                return _Locked(head, self._lock) if head is not None else None
            return heads
        return value


def _locked_call(fn: Callable[..., Any], lock: FairLock) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return fn(*args, **kwargs)
    return call


class _Call:
    """A slot's decode step or verify pass waiting for its joint pass."""

    def __init__(self, item: JointItem) -> None:
        self.item = item
        self.claimed = False  # taken into a pass
        self.done = False
        self.result: Any = None


class JointRounds:
    """Gathers the running slots' decode steps and verify passes into joint forward passes (module docstring).

    Args:
        run: runs a list of items as one pass and returns each one's result or exception (the model's
            ``joint_forward``, or ``run_alone``); called under ``lock``.
        lock: the slots' FairLock.
        gather_s: the longest a call waits for the other running slots' calls before its pass runs without them.
        alone: runs a pass of one item (default ``run``): the model's own verbs (``run_alone``), whose recorded
            launch plans make a lone slot's round as fast as an engine of one slot; the same bits.
    Attributes: passes, items: joint passes run and the items they carried (items / passes: the mean batch).
    """

    def __init__(self, run: Callable[[list[JointItem]], list[Any]], lock: FairLock, gather_s: float = 0.05,
                 alone: Callable[[list[JointItem]], list[Any]] | None = None) -> None:
        self.run = run
        self.alone = alone or run
        self.lock = lock
        self.gather_s = gather_s
        self.passes = 0
        self.items = 0
        self._cond = threading.Condition()
        self._active: dict[int, int] = {}  # running slot -> the thread its calls come from
        self._pending: dict[int, _Call] = {}

    def call(self, slot: int, item: JointItem) -> Any:
        """Run ``item`` for ``slot`` in the next joint pass; its result (the verb's return value).

        The call waits until every running slot has a call in (or ``gather_s`` has passed), then for the lock; the
        thread that holds the lock takes every call waiting at that moment into its pass (so the calls that queued
        behind a running pass go together in the next one) and runs it; the others find their result.
        Raises: the ValueError the verb would raise for this item."""
        me = threading.get_ident()
        call = _Call(item)
        with self._cond:
            self._active[slot] = me
            self._pending[slot] = call
            self._cond.notify_all()
            deadline = time.monotonic() + self.gather_s
            while not call.claimed:
                # every running slot has its call in, except those of this thread (a caller alternating several
                # generations in one thread cannot bring them in while it waits here)
                ready = all(s in self._pending or t == me for s, t in self._active.items())
                left = deadline - time.monotonic()
                if ready or left <= 0:
                    break
                self._cond.wait(left)
        if not call.claimed:
            with self.lock:
                with self._cond:
                    batch = [] if call.claimed else [self._pending.pop(s) for s in sorted(self._pending)]
                    for c in batch:
                        c.claimed = True
                if batch:
                    try:
                        results = (self.alone if len(batch) == 1 else self.run)([c.item for c in batch])
                    except BaseException as exc:  # every call of the pass fails with it, none waits forever
                        results = [exc] * len(batch)
                    with self._cond:
                        self.passes += 1
                        self.items += len(batch)
                        for c, r in zip(batch, results):
                            c.result, c.done = r, True
                        self._cond.notify_all()
        with self._cond:
            while not call.done:
                self._cond.wait()
        if isinstance(call.result, BaseException):
            raise call.result
        return call.result

    def running(self) -> int:
        """Slots in their rounds now (their generation between its first decode or verify and its end)."""
        with self._cond:
            return len(self._active)

    def leave(self, slot: int) -> None:
        """``slot``'s generation has ended: the passes stop waiting for it."""
        with self._cond:
            self._active.pop(slot, None)
            self._cond.notify_all()


def run_alone(model: Any) -> Callable[[list[JointItem]], list[Any]]:
    """A ``JointRounds`` runner for a model without ``joint_forward``: each item through its own verb, one after the
    other (protocol.run_items_alone: the results of a joint pass without its shared weight reads)."""
    return lambda items: run_items_alone(model, items)


class SlotModel(_Locked):
    """The model as a slot sees it: the adapter's verbs (``prefill``, ``decode``, ``verify_tree``, ``commit``,
    ``choose_on_device``...) each under the pool's ``FairLock``, or with ``rounds``, ``decode`` and ``verify_tree``
    through the joint rounds; ``hp``, ``capabilities`` and every other attribute are the adapter's. Its MTP head
    (``draft_heads()``) is wrapped the same way."""

    def __init__(self, target: Any, lock: FairLock, rounds: JointRounds | None = None, slot: int = 0) -> None:
        super().__init__(target, lock)
        self._rounds = rounds
        self._slot = slot

    def __getattr__(self, name: str) -> Any:
        rounds = self._rounds
        if rounds is not None and name == "decode":
            def decode(state: Any, token: Any, hidden_out: list[Any] | None = None) -> Any:
                return rounds.call(self._slot, JointItem(state, [token], hidden_out=hidden_out))
            return decode
        if rounds is not None and name == "verify_tree":
            def verify_tree(state: Any, scratch: Any, token_ids: Sequence[int], parent_ids: Sequence[int]) -> Any:
                return rounds.call(self._slot, JointItem(state, list(token_ids), list(parent_ids), scratch))
            return verify_tree
        return super().__getattr__(name)


class Slot:
    """One request's resources: ``index`` (0..N-1), ``model`` (the adapter, or a ``SlotModel`` when N > 1), the
    speculator (None: speculation off) and the kept device state of its last sequence (``spare``).

    Attributes: spare: a device state kept for reuse (``Engine._take_state``), or None; requests: requests served.
    """

    def __init__(self, index: int, model: Any, speculator: Any) -> None:
        self.index = index
        self.model = model
        self.speculator = speculator
        self.spare: Any = None
        self.requests = 0


class SlotPool:
    """N slots over one model: ``acquire`` the lowest free one (waiting while all are taken), ``release`` it.

    Args:
        size: N, at least 1.
        make_slot: builds slot i (called once per slot, on its first use).
    Attributes: lock: the ``FairLock`` every slot's model calls hold (N > 1).
    Raises: ValueError for a size below 1.
    """

    def __init__(self, size: int, make_slot: Callable[[int], Slot]) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"parallel must be an integer of at least 1, got {size!r}")
        self.size = size
        self.lock = FairLock()
        self._make = make_slot
        self._slots: list[Slot | None] = [None] * size
        self._free = list(range(size))
        self._cond = threading.Condition()

    @property
    def running(self) -> int:
        """Slots held by a request now."""
        with self._cond:
            return self.size - len(self._free)

    def acquire(self, timeout_s: float | None = None) -> Slot:
        """The lowest-numbered free slot, built on its first use; waits while every slot is held.
        Raises: TimeoutError when none frees within ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout_s):
                raise TimeoutError(f"no free slot of {self.size} within {timeout_s} s")
            self._free.sort()
            index = self._free.pop(0)
        try:
            slot = self._slots[index]
            if slot is None:
                slot = self._slots[index] = self._make(index)
        except BaseException:
            self.release_index(index)
            raise
        slot.requests += 1
        return slot

    def release(self, slot: Slot) -> None:
        """Hand ``slot`` back (its spare state stays with it)."""
        self.release_index(slot.index)

    def release_index(self, index: int) -> None:
        """Hand slot ``index`` back."""
        with self._cond:
            if index not in self._free:
                self._free.append(index)
            self._cond.notify()

    def built(self) -> list[Slot]:
        """The slots built so far (idle or running)."""
        return [s for s in self._slots if s is not None]
