"""Row invariance on every CPU kernel (issue 48, clause 5): the NumPy engine gives a row the same bits for 1 and N
rows whichever kernels OpenBLAS picks for the host, so the checks run in subprocesses with OpenBLAS's core type
forced (``OPENBLAS_CORETYPE``, read once at load) to kernels of different vector widths, one of them single-threaded.

Each child checks, under its kernels: Linear rows (every shape a GEMV a row) of one call == one-row calls == pieces
== rows at another alignment; ``gdn_rows`` == ``gdn_step`` token by token on a state copy at another alignment;
``attention_rows`` rows == one-row calls; a tiny model's prefill in one pass == in pieces == decode token by token,
and a verified tree's rows == plain decodes of their paths. Sources: tandem/formats/linear.py,
tandem/backend/numpy_ops.py, tandem/models/qwen3_5/model.py and verify.py. Skipped where NumPy's BLAS is not
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

ROOT = Path(__file__).resolve().parents[1]

# Forced core types (OpenBLAS names) and the x86 flags (/proc/cpuinfo) their kernels need; Prescott runs the SSE3
# kernels (OpenBLAS reports them as Katmai), Sandybridge AVX, Haswell AVX2 + FMA.
CORES = {"Haswell": {"avx2", "fma"}, "Sandybridge": {"avx"}, "Prescott": {"pni"}}
SINGLE_THREADED = "Sandybridge"  # its child also runs with OPENBLAS_NUM_THREADS=1


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


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` one float32 past the start of a fresh buffer (another alignment than ``a``'s)."""
    out = np.empty(a.size + 1, np.float32)[1:].reshape(a.shape)
    out[...] = a
    return out


def check_rows() -> dict[str, str | int]:
    """The row checks under this process's BLAS kernels (raises AssertionError naming the first difference)."""
    from tandem.backend import numpy_ops as ops
    from tandem.formats import DenseLinear
    from tandem.models.qwen3_5.model import Qwen3_5Model
    from tools.make_checkpoint import write_checkpoint

    rng = np.random.default_rng(0)
    for shape in ((1024, 384), (384, 640), (128, 384), (96, 64), (8, 384), (7, 5)):
        lin = DenseLinear(rng.standard_normal(shape).astype(np.float32))
        x = rng.standard_normal((40, shape[1])).astype(np.float32)
        single = np.stack([lin.matmul(x[i:i + 1])[0] for i in range(40)])
        assert np.array_equal(lin.matmul(x), single), f"Linear {shape}: 40 rows"
        assert np.array_equal(np.concatenate([lin.matmul(x[:17]), lin.matmul(x[17:])]), single), f"{shape}: pieces"
        assert np.array_equal(lin.matmul(_misaligned(x)), single), f"Linear {shape}: misaligned rows"

    hv, dk, dv, t = 8, 64, 64, 24
    q = ops.l2norm(rng.standard_normal((t, hv, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    k = ops.l2norm(rng.standard_normal((t, hv, dk)).astype(np.float32))
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g = (-rng.uniform(0.0, 3.0, (t, hv))).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, hv)).astype(np.float32)
    start = rng.standard_normal((hv, dk, dv)).astype(np.float32)
    rows, steps = start.copy(), _misaligned(start)
    o_rows = ops.gdn_rows(rows, q, k, v, g, beta)
    o_steps = np.stack([ops.gdn_step(steps, q[i].copy(), k[i].copy(), v[i], g[i], beta[i]) for i in range(t)])
    assert np.array_equal(o_rows, o_steps) and np.array_equal(rows, steps), "gdn_rows != gdn_step"

    length, t = 300, 20
    keys = rng.standard_normal((length, 2, 32)).astype(np.float32)
    values = rng.standard_normal((length, 2, 32)).astype(np.float32)
    qa = rng.standard_normal((t, 6, 32)).astype(np.float32)
    pos = np.arange(length - t, length)
    got = ops.attention_rows(qa, keys, values, pos)
    for r in range(t):
        one = ops.attention_rows(_misaligned(qa[r:r + 1]), keys, values, pos[r:r + 1])[0]
        assert np.array_equal(got[r], one), f"attention_rows row {r}"

    with tempfile.TemporaryDirectory() as tmp:
        model = Qwen3_5Model.load(write_checkpoint(Path(tmp), init_std=0.1, seed=5, with_vision=False, num_shards=1))
    ids = rng.integers(0, model.hp.vocab_size, 70).tolist()
    one_pass = model.new_state(80)
    all_logits = model.prefill(one_pass, ids, all_logits=True)
    pieces = model.new_state(80)
    for a, b in ((0, 1), (1, 33), (33, 64), (64, 70)):
        assert np.array_equal(model.prefill(pieces, ids[a:b]), all_logits[b - 1]), f"prefill piece [{a}, {b})"
    stepped = model.new_state(80)
    model.prefill(stepped, ids[:1])
    for p in range(1, 70):
        assert np.array_equal(model.decode(stepped, ids[p]), all_logits[p]), f"decode at {p} != prefill row"
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    tokens = rng.integers(0, model.hp.vocab_size, len(parents)).tolist()
    entry = model.new_state(80)
    entry.copy_from(one_pass)
    verified = model.verify_tree(one_pass, model.new_tree_scratch(len(parents)), tokens, parents)
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        plain = model.new_state(80)
        plain.copy_from(entry)
        for n in reversed(path):
            want = model.decode(plain, tokens[n])
        assert np.array_equal(verified[node], want), f"verify node {node} != decode of its path"
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
