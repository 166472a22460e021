"""The one loader of `cuda/*.cu`: NVRTC through cupy.RawModule, once per source hash and device arch.

Every kernel source lives in the repository's `cuda/` folder; a wheel ships a copy as package data in
`tandem/backend/cuda/src/` (setup.py's build_py step). `CUDA_DIR` is the repository's folder when it exists (a
checkout or an editable install), else the packaged copy; this module is the one place that knows where.
`load_module("gemv")` reads `cuda/gemv.cu`, inlines each `#include "<name>.cuh"` from the same folder (so the hash
that keys the compile cache covers the headers too), prepends `#line 1 "cuda/gemv.cu"` (and a `#line` around
each inlined header) so NVRTC errors name the real file and line, and compiles it for the current device's arch
(CuPy picks `sm_XY` from the device). CuPy keeps the compiled binary on disk, keyed by a hash of the source, the
options, the arch and the NVRTC version (`CUPY_CACHE_DIR`, default ~/.cupy/kernel_cache), so a second process
loads it without compiling; this module keeps one RawModule per (source hash, device) in memory; sources are read
once a process.

Options: C++17 and no fast math anywhere: kernels must match the NumPy reference's rounding where it is written
out (`__fmul_rn`, `__fadd_rn`) and keep row invariance, and `--use_fast_math` would change expf / division /
sqrt and flush subnormals. CuPy is imported lazily so the CPU package never needs it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from pathlib import Path
from typing import Any

REPO_CUDA_DIR = Path(__file__).resolve().parents[3] / "cuda"
PACKAGED_CUDA_DIR = Path(__file__).resolve().parent / "src"


def find_cuda_dir(repo: Path = REPO_CUDA_DIR, packaged: Path = PACKAGED_CUDA_DIR) -> Path:
    """The folder holding the `.cu` sources: the repository's `cuda/` if it has any, else the wheel's copy.

    Raises: FileNotFoundError naming both places when neither holds a `.cu` file.
    """
    for folder in (repo, packaged):
        # the repository's cuda/ only beside its setup.py: an installed copy's parents[3] is site-packages, whose
        # cuda/ may belong to NVIDIA's Python packages
        if folder == repo and not (folder.parent / "setup.py").is_file():
            continue
        if folder.is_dir() and any(folder.glob("*.cu")):
            return folder
    raise FileNotFoundError(f"no CUDA kernel sources: neither {repo} nor {packaged} holds a .cu file "
                            "(reinstall tandem, or run from a checkout)")


def _cuda_dir_or_default() -> Path:
    try:
        return find_cuda_dir()
    except FileNotFoundError:  # importing the CPU package must not fail; loading a kernel will say why
        return REPO_CUDA_DIR


CUDA_DIR = _cuda_dir_or_default()
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)
# Sources built for the arch-specific target on sm_90 (sm_90a: wgmma, cuda/gemv.cu gemv_mma_wg); elsewhere they build
# for the plain arch and those kernels are left out (they trap; the launchers do not pick them).
ARCH_SPECIFIC = ("gemv",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([A-Za-z0-9_]+\.cuh)"\s*$')
_modules: dict[tuple[str, int], Any] = {}
_functions: dict[tuple[str, str, int], Any] = {}


def cupy() -> Any:
    """The cupy module, imported on first use. Raises ImportError without CuPy."""
    import cupy as cp

    return cp


def persistent() -> Any:
    """Context: allocate from CuPy's default pool even while a launch plan records into its own pool (for
    buffers that outlive the plan: model and scratch buffers made on first use)."""
    cp = cupy()
    return cp.cuda.using_allocator(cp.get_default_memory_pool().malloc)


def gpu_available() -> bool:
    """Whether CuPy imports and sees at least one CUDA device."""
    try:
        return int(cupy().cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


@functools.lru_cache(maxsize=None)
def kernel_source(stem: str) -> str:
    """The full text NVRTC compiles for `cuda/<stem>.cu`: headers inlined, `#line` directives added.

    Raises: FileNotFoundError if the source or an included header is missing.
    """
    path = CUDA_DIR / f"{stem}.cu"
    lines = [f'#line 1 "cuda/{path.name}"']
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _INCLUDE.match(line)
        if match is None:
            lines.append(line)
            continue
        header = CUDA_DIR / match.group(1)
        lines += [f'#line 1 "cuda/{header.name}"', header.read_text(), f'#line {number + 1} "cuda/{path.name}"']
    return "\n".join(lines) + "\n"


def compute_capability() -> str:
    """The current device's compute capability as CuPy spells it ("90" for sm_90). Raises ImportError without
    CuPy."""
    return str(cupy().cuda.Device().compute_capability)


def extra_defines() -> tuple[str, ...]:
    """``-D`` options from ``TANDEM_CUDA_DEFINES`` (comma- or space-separated ``NAME`` or ``NAME=VALUE`` items): a
    measuring aid for A/B runs of a compile-time switch in one checkout (e.g. ``TANDEM_TRACE`` for
    bench/trace_step.py, ``GEMV_WLOAD=0``); empty when unset, as in the engine.

    Raises: ValueError on an item that is not a C identifier with an optional ``=VALUE``."""
    items = [x for x in re.split(r"[,\s]+", os.environ.get("TANDEM_CUDA_DEFINES", "")) if x]
    for item in items:
        if not re.fullmatch(r"[A-Za-z_]\w*(=[\w.+-]*)?", item):
            raise ValueError(f"TANDEM_CUDA_DEFINES: {item!r} is not NAME or NAME=VALUE")
    return tuple(f"-D{x}" for x in items)


def nvrtc_options(stem: str, capability: str) -> tuple[str, ...]:
    """NVRTC options for `cuda/<stem>.cu` on a device of ``capability``: NVRTC_OPTIONS, plus the arch-specific
    target sm_90a for ARCH_SPECIFIC sources on sm_90 (the same code, with the wgmma kernels built), plus
    `extra_defines()`."""
    if stem in ARCH_SPECIFIC and capability == "90":
        return NVRTC_OPTIONS + ("--gpu-architecture=sm_90a",) + extra_defines()
    return NVRTC_OPTIONS + extra_defines()


@functools.lru_cache(maxsize=None)
def source_hash(stem: str, capability: str = "") -> str:
    """sha256 of the compiled text and options: the key under which a module is cached."""
    text = kernel_source(stem) + "\0" + " ".join(nvrtc_options(stem, capability))
    return hashlib.sha256(text.encode()).hexdigest()


def load_module(stem: str) -> Any:
    """The compiled cupy.RawModule of `cuda/<stem>.cu` for the current device (compiled at most once).

    Raises: ImportError without CuPy; cupy.cuda.compiler.CompileException with NVRTC's log on a build error.
    """
    cp = cupy()
    capability = compute_capability()
    key = (source_hash(stem, capability), int(cp.cuda.Device().id))
    module = _modules.get(key)
    if module is None:
        module = cp.RawModule(code=kernel_source(stem), options=nvrtc_options(stem, capability))
        module.compile()
        _modules[key] = module
    return module


_fast: dict[tuple[str, str], tuple[int, Any]] = {}
# plan.LaunchPlan.record()'s hook: wraps each kernel handed out so its launches are noted. Per thread: a recording
# notes only the launches of the thread that records it, never those another thread makes meanwhile (the engine's
# slots launch device sampling outside their lock while another slot records a plan; such a launch, replayed with
# the other thread's freed buffers, would write into memory reused since).
_local = threading.local()


def recorder() -> Any:
    """The calling thread's recording hook (None when it records no launch plan)."""
    return getattr(_local, "recorder", None)


def set_recorder(hook: Any) -> Any:
    """Set the calling thread's recording hook (None: none); returns the one it replaces."""
    previous = recorder()
    _local.recorder = hook
    return previous


def kernel(stem: str, name: str) -> Any:
    """One `extern "C"` kernel of `cuda/<stem>.cu` as a cupy.RawKernel (looked up once per device).

    The common case (the device of the last lookup of this kernel) is one dict lookup and one cheap
    device query through CuPy's cached current device."""
    cp = cupy()
    dev = cp.cuda.Device().id
    hit = _fast.get((stem, name))
    if hit is not None and hit[0] == dev:
        fn = hit[1]
    else:
        key = (stem, name, int(dev))
        fn = _functions.get(key)
        if fn is None:
            fn = _functions[key] = load_module(stem).get_function(name)
        _fast[(stem, name)] = (int(dev), fn)
    hook = getattr(_local, "recorder", None)
    return fn if hook is None else hook(fn)


_smem_limits: dict[int, int] = {}


def raise_smem_limit(fn: Any, nbytes: int) -> None:
    """Let kernel `fn` (from `kernel`) launch with `nbytes` of dynamic shared memory: the CUDA function attribute
    MAX_DYNAMIC_SHARED_SIZE_BYTES must cover it, and without it the kernel's static and dynamic shared memory together
    may not pass 48 KiB (tree_partial: 10.5 KiB static, so a 40 KiB launch at head dim 160 needs it). Every launch
    of such a kernel goes through here, and the limit is set to the largest `nbytes` seen so far: it only ever rises,
    so a recorded launch plan (plan.py) that replays a larger launch of the same kernel stays valid (lowering it made
    such a replay fail with CUDA_ERROR_INVALID_VALUE). Raises what CuPy raises past the device's opt-in maximum."""
    ptr = int(fn.kernel.ptr)
    if nbytes > _smem_limits.get(ptr, 0):
        fn.max_dynamic_shared_size_bytes = nbytes
        _smem_limits[ptr] = nbytes


def kernel_names(stem: str) -> list[str]:
    """Names of the `extern "C" __global__` kernels that `cuda/<stem>.cu` defines, read without CuPy (the
    inventory test uses it). A kernel stamped out by a macro keeps its token paste: `gemv_bf16_t##TT`. Attributes
    before the name (`__launch_bounds__(256)`, an upper-case attribute macro such as `S_CLUSTER_DIMS`) are skipped."""
    text = (CUDA_DIR / f"{stem}.cu").read_text()
    return re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:(?:__\w+__\([^)]*\)|[A-Z][A-Z0-9_]*)\s+)*'
                      r'([A-Za-z_]\w*(?:##\w+)?)\s*\(', text)
