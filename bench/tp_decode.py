"""``bench/decode.py --tp N``: decode over a tensor-parallel mesh (tandem/parallel/cuda_mesh.py) against one GPU,
on synthetic checkpoints of the 9B / 27B shapes, in one run.

Each rank is bench/decode.py's ``build`` of the rank's shape (attention, KV and GDN heads, the MLP width and the
vocabulary divided by N) on its device, the mesh over them with the collective the devices call for (NCCL over
distinct GPUs, ``LocalCollective`` when ``--tp-devices`` repeats one GPU: then the ranks take turns on it, and the
figure is the mesh's cost, not its speed). Reports, per format: one GPU's decode ms a token (the engine's launch
plans and fused epilogues), the mesh's decode ms a token (prefill of 128 tokens, then timed steps, each with the
logits on the host) and the ratio. Random weights: the two do not compute the same tokens (the tests compare them).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import cupy as cp
import numpy as np

from tandem.parallel.collective import make_collective
from tandem.parallel.cuda_mesh import CudaMeshModel
from tandem.parallel.plan import ShardPlan


def rank_shape(c: dict[str, int], n: int) -> dict[str, int]:
    """A rank's synthetic shape: the split dimensions of ``c`` divided by n."""
    out = dict(c)
    for key in ("heads", "kv_heads", "gdn_k_heads", "gdn_v_heads", "mlp", "vocab"):
        if c[key] % n:
            raise SystemExit(f"--tp {n} does not divide {key} ({c[key]})")
        out[key] = c[key] // n
    return out


def _decode_ms(model: Any, steps: int, sync: Any) -> float:
    """Median wall ms of one decode step (logits to the host) after a 128-token prefill and 3 warm-up steps."""
    rng = np.random.default_rng(0)
    vocab = int(model.hp.vocab_size)
    state = model.new_state(128 + steps + 8)
    model.prefill(state, rng.integers(0, vocab, 128).tolist())
    for t in rng.integers(0, vocab, 3).tolist():
        model.decode(state, int(t))
    sync()
    times = []
    for t in rng.integers(0, vocab, steps).tolist():
        t0 = time.perf_counter()
        logits = model.decode(state, int(t))
        if not isinstance(logits, np.ndarray):
            cp.asnumpy(logits)  # the id's read, as the mesh's host logits
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def run(shapes: dict[str, dict[str, int]], formats: list[str], n: int, devices: list[int], kv_dtype: str,
        result: dict[str, Any]) -> None:
    """Fill ``result["tp"]`` with the mesh's and one GPU's decode ms per shape and format, printing each line."""
    from bench.decode import build, hparams

    result["tp"] = {"n": n, "devices": devices, "kv_dtype": kv_dtype, "shapes": {}}
    for shape, c in shapes.items():
        hp = hparams(c)
        for fmt in formats:
            cp.random.seed(1)
            with cp.cuda.Device(devices[0]):
                single = build(fmt, c, kv_dtype)
                one_ms = _decode_ms(single, 20, lambda: cp.cuda.Device(devices[0]).synchronize())
            del single
            cp.get_default_memory_pool().free_all_blocks()
            ranks = []
            for dev in devices:
                with cp.cuda.Device(dev):
                    ranks.append(build(fmt, rank_shape(c, n), kv_dtype))
            mesh = CudaMeshModel(hp, ShardPlan(hp, n), ranks, make_collective(devices))
            mesh_ms = _decode_ms(mesh, 20, mesh.synchronize)
            del mesh, ranks
            for dev in set(devices):
                with cp.cuda.Device(dev):
                    cp.get_default_memory_pool().free_all_blocks()
            row = {"one_gpu_ms": round(one_ms, 3), "mesh_ms": round(mesh_ms, 3),
                   "speedup": round(one_ms / mesh_ms, 3)}
            result["tp"]["shapes"].setdefault(shape, {})[fmt] = row
            print(f"{shape} {fmt:6s} --tp {n} on {devices}: one GPU {one_ms:.3f} ms/tok, mesh {mesh_ms:.3f} ms/tok "
                  f"({one_ms / mesh_ms:.2f}x)", flush=True)
