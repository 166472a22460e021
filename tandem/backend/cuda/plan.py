"""Record once, launch many: a fixed sequence of kernel launches replayed with almost no Python per launch.

A decode step launches the same kernels with the same arguments every time, except for a few (the token, the
position). `LaunchPlan.record()` captures the launches that the launchers make (through `loader.kernel`) while
the step runs normally; afterwards `replay()` issues them again through `cupy.cuda.driver.launchKernel` with
argument blocks built once (ctypes), about 4 µs of host time a launch on an H200 host against ~20 µs through
the launchers (bench/launch.py, bench/host_profile.py). Launches whose arguments change from step to step are
recorded as Python callables instead (`add_call`), which run their launchers normally.

This is not a CUDA graph: every launch is an ordinary launch on the current stream (DESIGN.md: no graphs).
Memory: arrays allocated while recording come from the plan's own memory pool, which the plan keeps for its
lifetime and nobody else allocates from. A temporary freed during the recording is reused by a later
allocation of the same recording exactly as CuPy's pool reuses it on one stream (in launch order), so a plan
needs about one layer's working set, not one per layer; the recorded launches keep raw pointers into that pool.
Arrays handed to `add_call` closures or kept in `outputs` stay referenced, so they are never reused.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tandem.backend.cuda import loader

_SCALARS: dict[type, Any] = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
                             np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def _dims(d: Any) -> tuple[int, int, int]:
    t = tuple(int(x) for x in (d if isinstance(d, tuple) else (d,)))
    return (t + (1, 1, 1))[:3]  # type: ignore[return-value]


class _Bound:
    """One launch with its argument block built once (None when an argument has no fixed C form)."""

    def __init__(self, fn: Any, grid: Any, block: Any, args: tuple[Any, ...], shared_mem: int) -> None:
        cp = loader.cupy()
        self.fn, self.grid, self.block, self.args, self.shared_mem = fn, grid, block, (), shared_mem
        objs: list[Any] = []
        for a in args:
            if isinstance(a, cp.ndarray):
                objs.append(ctypes.c_void_p(a.data.ptr))
            elif a is None:
                objs.append(ctypes.c_void_p(0))
            elif type(a) in _SCALARS:
                objs.append(_SCALARS[type(a)](a.item()))
            else:  # a Python scalar or anything else: let CuPy convert it at each launch (keeps the arrays)
                self.params = None
                self.args = args
                return
        self.objs = objs
        self.params = (ctypes.c_void_p * max(1, len(objs)))(*[ctypes.addressof(o) for o in objs])
        self.ptr = int(fn.kernel.ptr)
        self.g, self.b = _dims(grid), _dims(block)

    def launch(self, stream: int) -> None:
        if self.params is None:
            self.fn(self.grid, self.block, self.args, shared_mem=self.shared_mem)
            return
        g, b = self.g, self.b
        loader.cupy().cuda.driver.launchKernel(self.ptr, g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem,
                                               stream, ctypes.addressof(self.params), 0)


class _Recorder:
    """What `loader.kernel` hands out while recording: launches through the real kernel, and notes each one."""

    def __init__(self, plan: LaunchPlan, fn: Any) -> None:
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_fn", fn)

    def __call__(self, grid: Any, block: Any, args: tuple[Any, ...], shared_mem: int = 0, **kwargs: Any) -> Any:
        if kwargs:
            raise ValueError(f"a recorded launch takes no options beyond shared_mem, got {sorted(kwargs)}")
        self._plan.steps.append(_Bound(self._fn, grid, block, tuple(args), int(shared_mem)))
        return self._fn(grid, block, args, shared_mem=shared_mem)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)


class LaunchPlan:
    """A recorded sequence of launches and callables. Attributes: steps; outputs (what the recording run
    returned, for the caller to hand out after a replay)."""

    def __init__(self) -> None:
        self.pool = loader.cupy().cuda.MemoryPool()  # every allocation made while recording
        self.steps: list[_Bound | Callable[[], None]] = []
        self.outputs: Any = None
        self.vars: dict[str, Any] = {}  # values the recorded calls read at each replay (a token, a position)
        self._recording = False

    @contextmanager
    def record(self) -> Iterator[LaunchPlan]:
        """Run the block normally and note every launch it makes through `loader.kernel`."""
        if loader.recorder is not None:
            raise RuntimeError("a launch plan is already recording")
        loader.recorder = lambda fn: _Recorder(self, fn)
        self._recording = True
        try:
            with loader.cupy().cuda.using_allocator(self.pool.malloc):
                yield self
        finally:
            loader.recorder = None
            self._recording = False

    def add_call(self, call: Callable[[], None]) -> None:
        """Run `call` now and at every replay (launches it makes are not recorded; its own temporaries come from
        the default pool, as at replay). Arrays it writes that recorded launches read must be held by the call."""
        saved, loader.recorder = loader.recorder, None
        try:
            with loader.cupy().cuda.using_allocator(loader.cupy().get_default_memory_pool().malloc):
                call()
        finally:
            loader.recorder = saved
        self.steps.append(call)

    def replay(self) -> None:
        """Issue every recorded launch and call again, in order, on the current stream."""
        stream = int(loader.cupy().cuda.get_current_stream().ptr)
        for step in self.steps:
            if isinstance(step, _Bound):
                step.launch(stream)
            else:
                step()

    def __len__(self) -> int:
        return len(self.steps)
