"""Record once, launch many: a fixed sequence of kernel launches replayed with almost no Python per launch.

A decode step launches the same kernels with the same arguments every time, except for a few (the token, the
position). `LaunchPlan.record()` captures the launches that the launchers make (through `loader.kernel`) while
the step runs normally; afterwards `replay()` issues them again through `cupy.cuda.driver.launchKernel` with
argument blocks built once (ctypes), at a fraction of the launchers' host time a launch (bench/launch.py,
bench/host_profile.py; docs/performance.md). Launches whose arguments change from step to step are
recorded as Python callables instead (`add_call`); the engine's (the embedding's token, attention's position and
chunk grid, a commit's start) launch through `Relaunch`, an argument block built once with those few values set in
place, at about a recorded launch's cost (bench/host_replay.py).

This is not a CUDA graph: every launch is an ordinary launch on the current stream (DESIGN.md: no graphs).
Replayed launches carry CUDA's programmatic stream serialization attribute (programmatic dependent launch, PDL,
sm_90+, through ``cuLaunchKernelEx``): a kernel may start while the one before it is still running, and before its
``pdl_wait()`` reads only what cuda/common.cuh's PDL rule 2 allows (constant weights, and data whose last writer
comes before the launch right before it: the GEMVs' first weight loads, the GDN state in gdn_decode_head and the
scan, the KV cache rows in tree_partial), so the next kernel's loads overlap the previous kernel's tail and the
launch gap.
Results are unchanged bit for bit (the arithmetic is the same). ``TANDEM_PDL=0`` in the environment, or a device
older than sm_90, replays with plain ``cuLaunchKernel``.
Memory: arrays allocated while recording come from the plan's own memory pool, which the plan keeps for its
lifetime and nobody else allocates from. A temporary freed during the recording is reused by a later
allocation of the same recording exactly as CuPy's pool reuses it on one stream (in launch order), so a plan
needs about one layer's working set, not one per layer; the recorded launches keep raw pointers into that pool.
Arrays handed to `add_call` closures or kept in `outputs` stay referenced, so they are never reused.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tandem.backend.cuda import loader

_SCALARS: dict[type, Any] = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
                             np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): id, 4 bytes of padding, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h, CUDA ≥ 12.0)."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL_ATTR = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
use_pdl = os.environ.get("TANDEM_PDL", "1") != "0"  # replays use PDL where the device has it (tests toggle it)
_launch_ex: Any = None  # libcuda's cuLaunchKernelEx once looked up, False where unavailable


def pdl_launcher() -> Any:
    """libcuda's ``cuLaunchKernelEx`` when replays use programmatic dependent launch, else None: off with
    ``use_pdl`` False (``TANDEM_PDL=0``), on devices before sm_90, or where the driver lacks the entry point."""
    global _launch_ex
    if not use_pdl:
        return None
    if _launch_ex is None:
        _launch_ex = False
        cp = loader.cupy()
        if int(cp.cuda.Device().compute_capability) >= 90:
            try:
                fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
            except (OSError, AttributeError):
                fn = None
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                _launch_ex = fn
    return _launch_ex or None


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
        self.config = _LaunchConfig(*self.g, *self.b, shared_mem, None, ctypes.addressof(_PDL_ATTR), 1)
        self.stream = -1

    def set_arg(self, index: int, value: int | float) -> None:
        """Change argument `index` of the built block in place (a scalar's value, or a pointer as an int address):
        later launches pass the new value. Raises TypeError on a launch without a built block."""
        if self.params is None:
            raise TypeError(f"{self.fn.name}: its arguments have no fixed C form")
        self.objs[index].value = value

    def set_grid(self, grid: tuple[int, int, int]) -> None:
        """Launch later with grid `grid` (x, y, z)."""
        self.g = grid
        self.config.grid_x, self.config.grid_y, self.config.grid_z = grid

    def launch(self, stream: int) -> None:
        if self.params is None:
            self.fn(self.grid, self.block, self.args, shared_mem=self.shared_mem)
            return
        launch_ex = pdl_launcher()
        if launch_ex is not None:
            if stream != self.stream:
                self.config.stream, self.stream = stream, stream
            err = launch_ex(ctypes.addressof(self.config), self.ptr, ctypes.addressof(self.params), None)
            if err:
                raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err} ({self.fn.name})")
            return
        g, b = self.g, self.b
        loader.cupy().cuda.driver.launchKernel(self.ptr, g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem,
                                               stream, ctypes.addressof(self.params), 0)


class Relaunch:
    """One kernel launched again and again with a few arguments changed between launches, through the replay path
    (an argument block built once, ``cuLaunchKernelEx`` with programmatic dependent launch where the device has it):
    for launches whose arguments follow the step (a position, a grid sized by it), which a LaunchPlan can then run
    as a cheap call (``add_call``) instead of through a launcher (several times less host time than through
    attention_decode_step; bench/host_replay.py).

    Args: fn: a kernel from ``loader.kernel`` (a cupy.RawKernel; inside a recording the recorder's wrapper is
    unwrapped: the launches are the caller's, not the plan's); grid, block: launch shape;
    args: the kernel's arguments: device arrays (their pointers are kept: the caller keeps the arrays alive), None
    (a null pointer) or NumPy scalars (np.int32, np.float32, ...); shared_mem: dynamic shared memory bytes.
    Raises: TypeError on an argument without a fixed C form (a Python int or float: pass np.int32 / np.float32).
    """

    def __init__(self, fn: Any, grid: Any, block: Any, args: tuple[Any, ...], shared_mem: int = 0) -> None:
        if isinstance(fn, _Recorder):
            fn = fn._fn  # the launches are the caller's, not the recording's
        self._bound = _Bound(fn, grid, block, args, shared_mem)
        if self._bound.params is None:
            raise TypeError(f"{fn.name}: every argument must be a device array, None or a NumPy scalar")

    def set(self, index: int, value: int | float) -> None:
        """Argument `index` takes `value` from the next launch on (a scalar's value, or an array's address)."""
        self._bound.set_arg(index, value)

    def launch(self, grid: tuple[int, int, int] | None = None) -> None:
        """Launch on the current stream, with grid `grid` (x, y, z) from now on if given."""
        if grid is not None:
            self._bound.set_grid(grid)
        self._bound.launch(int(loader.cupy().cuda.get_current_stream().ptr))


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


_recordings = 0  # LaunchPlan recordings started in this process (``recordings``)


def recordings() -> int:
    """How many launch plans this process has started recording: a caller that times work (StairCut's prices)
    compares it before and after to leave out a measurement that included a recording (a recording takes several
    times the host time of the replay it would price)."""
    return _recordings


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
        """Run the block normally and note every launch it makes through `loader.kernel` in this thread (another
        thread's launches meanwhile are not part of the plan: loader.set_recorder is per thread, as CuPy's
        allocator choice is). Raises: RuntimeError if this thread is already recording a plan."""
        global _recordings
        if loader.recorder() is not None:
            raise RuntimeError("a launch plan is already recording")
        _recordings += 1
        loader.set_recorder(lambda fn: _Recorder(self, fn))
        self._recording = True
        try:
            with loader.cupy().cuda.using_allocator(self.pool.malloc):
                yield self
        finally:
            loader.set_recorder(None)
            self._recording = False

    def add_call(self, call: Callable[[], None]) -> None:
        """Run `call` now and at every replay (launches it makes are not recorded; its own temporaries come from
        the default pool, as at replay). Arrays it writes that recorded launches read must be held by the call."""
        saved = loader.set_recorder(None)
        try:
            with loader.cupy().cuda.using_allocator(loader.cupy().get_default_memory_pool().malloc):
                call()
        finally:
            loader.set_recorder(saved)
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
