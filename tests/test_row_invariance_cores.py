"""Row invariance on every CPU kernel (issue 48, clause 5): the NumPy engine gives a row the same bits for 1 and N
rows whichever kernels OpenBLAS picks for the host, so the checks run in subprocesses with OpenBLAS's core type
forced (``OPENBLAS_CORETYPE``, read once at load) to kernels of different vector widths, one of them single-threaded.

Each child runs tests/row_checks.py under its kernels: Linear rows (every shape a GEMV a row) of one call ==
one-row calls == pieces == strided and misaligned rows; ``gdn_rows`` == ``gdn_step`` token by token on a state copy
at another alignment; ``attention_rows`` rows == one-row calls; a tiny model's prefill in one pass == in pieces ==
decode token by token, and a verified tree's rows == plain decodes of their paths. Skipped where NumPy's BLAS is not
OpenBLAS, off x86-64 Linux, or where fewer than two forced core types differ from each other on this host.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import row_checks  # tests/ (a child runs this file as a script: its folder is on the path)

ROOT = Path(__file__).resolve().parents[1]

# Forced core types (OpenBLAS names) and the x86 flags (/proc/cpuinfo) their kernels need; Prescott runs the SSE3
# kernels (OpenBLAS reports them as Katmai), Sandybridge AVX, Haswell AVX2 + FMA.
CORES = {"Haswell": {"avx2", "fma"}, "Sandybridge": {"avx"}, "Prescott": {"pni"}}
SINGLE_THREADED = "Sandybridge"  # its child also runs with OPENBLAS_NUM_THREADS=1
pytestmark = pytest.mark.slow  # three children, each loading NumPy and a model: OpenBLAS's kernels, not mypyc's


def openblas_core() -> str | None:
    """The core type name of the OpenBLAS this process's NumPy loaded, or None (another BLAS, or no getter)."""
    lib = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "openblas" in line.lower() and line.split()[-1].startswith("/")), None)
    if lib is None:
        return None
    handle = ctypes.CDLL(lib)
    for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                   "openblas_get_corename"):
        getter = getattr(handle, symbol, None)
        if getter is not None:
            getter.restype = ctypes.c_char_p
            name: bytes = getter()
            return name.decode()
    return None


def _flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def check_rows() -> dict[str, str | int]:
    """The row checks (tests/row_checks.py) under this process's BLAS kernels (raises AssertionError naming the
    first difference)."""
    from tandem.formats import DenseLinear
    from tandem.models.qwen3_5.model import Qwen3_5Model
    from tools.make_checkpoint import write_checkpoint

    rng = np.random.default_rng(0)
    for shape in ((1024, 384), (384, 640), (128, 384), (96, 64), (8, 384), (7, 5)):
        lin = DenseLinear(rng.standard_normal(shape).astype(np.float32))
        row_checks.linear_rows(lin, rng.standard_normal((40, shape[1])).astype(np.float32), [(0, 17), (17, 40)])
    row_checks.gdn_rows_are_steps(*row_checks.gdn_inputs(rng, 24, 8, 64, 64))
    length, t = 300, 20
    keys = rng.standard_normal((length, 2, 32)).astype(np.float32)
    values = rng.standard_normal((length, 2, 32)).astype(np.float32)
    row_checks.attention_rows_are_one_row_calls(rng.standard_normal((t, 6, 32)).astype(np.float32), keys, values,
                                                np.arange(length - t, length))
    with tempfile.TemporaryDirectory() as tmp:
        model = Qwen3_5Model.load(write_checkpoint(Path(tmp), init_std=0.1, seed=5, with_vision=False, num_shards=1))
    ids = rng.integers(0, model.hp.vocab_size, 70).tolist()
    state, _, _ = row_checks.prefill_pieces_and_decode(model, ids, [[(0, 1), (1, 33), (33, 64), (64, 70)]], 80)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    row_checks.verify_rows_are_decodes(model, state, rng.integers(0, model.hp.vocab_size, len(parents)).tolist(),
                                       parents)
    return {"core": openblas_core() or "?", "threads": os.environ.get("OPENBLAS_NUM_THREADS", "default")}


def _run_child(core: str) -> dict[str, str | int]:
    env = dict(os.environ, OPENBLAS_CORETYPE=core, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.pop("OPENBLAS_VERBOSE", None)
    if core == SINGLE_THREADED:
        env["OPENBLAS_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"OPENBLAS_CORETYPE={core}: rows differ\n{done.stderr[-3000:]}"
    found: dict[str, str | int] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_rows_are_invariant_under_every_forced_core_type() -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("forced OpenBLAS core types are checked on x86-64 Linux")
    if openblas_core() is None:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS that reports its core type")
    flags = _flags()
    cores = [c for c, need in CORES.items() if need <= flags]
    results = {core: _run_child(core) for core in cores}
    names = {r["core"] for r in results.values()}
    if len(names) < 2:
        pytest.skip(f"fewer than two distinct kernels ran here: {results}")
    assert results.get(SINGLE_THREADED, {"threads": "1"})["threads"] == "1"


if __name__ == "__main__":
    print(json.dumps(check_rows()))
