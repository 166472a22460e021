"""Where a decode step's time goes in the engine's own launch stream (PDL on, no serialization): a %globaltimer trace.

Nsight Compute times kernels one at a time with the caches flushed (bench/verify_kernels.py), which hides what
programmatic dependent launch overlaps and what it cannot. This builds every kernel with TANDEM_TRACE (cuda/common.cuh:
thread 0 of a grid's first and last 264 blocks records the time before and after its pdl_wait(), and the one-tile GEMVs
also when their main loop, their epilogue and the residual + norm tail are done), replays the recorded decode plan for a
few steps with no host sync between them (decode + argmax, as bench/decode.py's no-sync loop), and lines the records
up with the plan's launches by %gridid (launch order) and grid shape.

Per launch, "release" is the earliest time any of its blocks got past pdl_wait (the kernel before it had finished and
its writes were visible); a launch's exposed time is the next launch's release less its own: what it adds to the
step. "lead" is how long before its release its first block was already on an SM (PDL's overlap). For GEMVs the
ideal is the weight bytes over the copy bandwidth measured in the same run. The tracer perturbs the timing a
little (a clock read and one 40-byte store a recording block and mark); compare the step total against
bench/decode.py's. --verify N traces N-node tree verifies (the verify plan) instead of decode steps.

python3 bench/trace_step.py [--shape 27b] [--formats nvfp4,fp8] [--steps 4] [--pos 128] [--verify N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ["TANDEM_CUDA_DEFINES"] = (os.environ.get("TANDEM_CUDA_DEFINES", "") + " TANDEM_TRACE").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from bench.decode import SHAPES, build, copy_bandwidth_gbps, random_tree  # noqa: E402
from tandem.backend.cuda import argmax, loader  # noqa: E402
from tandem.backend.cuda.plan import _Bound  # noqa: E402

REC = np.dtype([("grid", "<u8"), ("t0", "<u8"), ("t1", "<u8"), ("shape", "<u8"), ("who", "<u8")])
GRIDS, EDGE = 4093, 264  # cuda/common.cuh TRACE_GRIDS, TRACE_EDGE
CAP = GRIDS * 2 * EDGE * 4  # records: one slot a (launch, edge block, kind)


def _global(module: Any, name: str, dtype: Any, n: int = 1) -> Any:
    return cp.ndarray((n,), dtype, module.get_global(name))


def point(ptr: int) -> None:
    """Point every loaded module's tracer at the record buffer at device address ``ptr`` (0: off). The records' slots
    come from their launch's %gridid, which is unique across modules, so one buffer serves them all."""
    for module in list(loader._modules.values()):
        try:
            _global(module, "tandem_trace_buf", cp.uint64)[0] = ptr
        except Exception:  # a module built without TANDEM_TRACE, or with no kernel that waits
            continue


def read_records(buf: Any) -> Any:
    """The records written, checked: every slot group (one %gridid mod GRIDS) holds one launch's records only.
    Raises RuntimeError when two launches of the trace shared a slot group (trace fewer steps)."""
    host = cp.asnumpy(buf).view(REC)
    recs = host[host["grid"] != 0]
    group = recs["grid"] % GRIDS
    for g in np.unique(group):
        if len(np.unique(recs["grid"][group == g])) > 1:
            raise RuntimeError(f"trace slot group {g} holds records of two launches: fewer --steps")
    return recs


def gemv_bytes(name: str, out_dim: int, in_dim: int) -> int:
    if "nvfp4" in name:
        return out_dim * in_dim // 2 + out_dim * in_dim // 16 + 4 * out_dim
    if "fp8" in name:
        return out_dim * in_dim + 4 * ((out_dim + 127) // 128) * ((in_dim + 127) // 128)
    return 2 * out_dim * in_dim


def plan_sequence(plan: Any) -> list[tuple[int, str, int] | None]:
    """The plan's launches in order: (grid shape as the tracer packs it, label, weight bytes) for a recorded launch
    (GEMVs labelled with their out x in), None for a call (its launches are not recorded: the embedding, attention)."""
    seq: list[tuple[int, str, int] | None] = []
    for step in plan.steps:
        if not isinstance(step, _Bound) or step.params is None:
            seq.append(None)
            continue
        g, b = step.g, step.b
        shape = g[0] | (g[1] << 24) | ((b[0] * b[1] * b[2]) << 40)
        name, nbytes = str(step.fn.name), 0
        if name.startswith("gemv_mma"):
            out_dim, in_dim = int(step.objs[5].value), int(step.objs[6].value)
            nbytes = gemv_bytes(name, out_dim, in_dim)
            name += f"[{out_dim}x{in_dim}]"
        seq.append((shape, name, nbytes))
    return seq


def trace_format(fmt: str, c: dict[str, int], steps: int, pos: int, copy_gbps: float,
                 nodes: int = 0, dump: str = "") -> dict[str, Any]:
    """Trace `steps` decode steps (nodes 0) or `steps` verifies of a `nodes`-node tree of format `fmt`."""
    m = build(fmt, c)
    state = m.new_state(pos + 80)
    m.prefill(state, np.random.default_rng(0).integers(0, c["vocab"], pos).tolist())
    if nodes:
        scratch = m.new_tree_scratch(nodes)
        parents = random_tree(nodes, nodes)
        ids = [int(t) for t in np.random.default_rng(nodes).integers(0, c["vocab"], nodes)]

        def run(n: int) -> None:
            for _ in range(n):
                m.verify_tree(state, scratch, ids, parents)
    else:
        def run(n: int) -> None:
            for _ in range(n):
                argmax.argmax(m.decode(state, 7)[None])
                state.length -= 1

    run(4)  # records the plan, compiles and loads every module
    cp.cuda.Device().synchronize()
    plan = next(iter(state.verify_plans.values())) if nodes else state.decode_plan
    labels = plan_sequence(plan)
    buf = cp.zeros(CAP * REC.itemsize, dtype=cp.uint8)
    point(buf.data.ptr)
    cp.cuda.Device().synchronize()
    run(steps)
    cp.cuda.Device().synchronize()
    point(0)
    recs = read_records(buf)
    del buf
    if dump:
        np.savez_compressed(dump, records=recs)
    return analyse(recs, labels, copy_gbps) | {"format": fmt, "nodes": nodes}


def analyse(recs: Any, labels: list[tuple[int, str, int] | None], copy_gbps: float) -> dict[str, Any]:
    kind = (recs["who"] >> 48) & 0xFFFF
    order = np.argsort(recs["grid"], kind="stable")
    recs, kind = recs[order], kind[order]
    cuts = np.flatnonzero(np.diff(recs["grid"])) + 1
    launches = []
    for sel, k in zip(np.split(recs, cuts), np.split(kind, cuts)):
        w = sel[k == 0]
        if len(w) == 0:
            continue
        row: dict[str, Any] = {"shape": int(w["shape"][0]), "start": int(w["t0"].min()),
                               "release": int(w["t1"].min()), "last_release": int(w["t1"].max())}
        for kk, key in ((1, "main_done"), (2, "epi_done"), (3, "norm_done")):
            s = sel[k == kk]
            if len(s):
                row[key] = int(s["t0"].max())
        launches.append(row)
    bound = [x for x in labels if x is not None]
    head_shape = max(bound, key=lambda x: x[2])[0] if bound else -1
    heads = [i for i, r in enumerate(launches) if r["shape"] == head_shape]
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    step_us = []
    for s in range(1, len(heads)):  # whole steps between consecutive heads: the argmax, then the plan's launches
        lo, hi = heads[s - 1] + 1, heads[s] + 1
        if hi >= len(launches):
            break
        step_us.append((launches[hi]["release"] - launches[lo]["release"]) / 1e3)
        p = 0
        for i in range(lo, hi):
            r, nxt = launches[i], launches[i + 1]
            q = p
            while q < len(labels) and labels[q] is None:
                q += 1
            lab = labels[q] if q < len(labels) else None
            if lab is not None and lab[0] == r["shape"]:
                name, nbytes, p = lab[1], lab[2], q + 1
            else:
                sh = r["shape"]
                name, nbytes = f"call:{sh & 0xFFFFFF}x{(sh >> 24) & 0xFFFF}x{sh >> 40}", 0
            d = per[name]
            d["exposed"].append((nxt["release"] - r["release"]) / 1e3)
            d["lead"].append((r["release"] - r["start"]) / 1e3)
            d["spread"].append((r["last_release"] - r["release"]) / 1e3)
            if nbytes:
                d["ideal"].append(nbytes / copy_gbps / 1e3)
            for key in ("main_done", "epi_done", "norm_done"):
                if key in r:
                    d[key].append((r[key] - r["release"]) / 1e3)
    table = {}
    for name, d in per.items():
        n = len(d["exposed"]) / max(1, len(step_us))
        table[name] = {"per_step": round(n, 2), "exposed_us_each": round(statistics.mean(d["exposed"]), 2),
                       "exposed_ms_step": round(sum(d["exposed"]) / max(1, len(step_us)) / 1e3, 3)}
        for key in ("ideal", "lead", "spread", "main_done", "epi_done", "norm_done"):
            if d[key]:
                table[name][f"{key}_us_each"] = round(statistics.mean(d[key]), 2)
    table = dict(sorted(table.items(), key=lambda kv: -kv[1]["exposed_ms_step"]))
    ideal_ms = sum(v.get("ideal_us_each", 0.0) * v["per_step"] for v in table.values()) / 1e3
    return {"steps_traced": len(step_us), "step_ms": [round(x / 1e3, 3) for x in step_us],
            "launches_per_step": (heads[1] - heads[0]) if len(heads) > 1 else 0,
            "gemv_ideal_ms_step": round(ideal_ms, 3), "by_kernel": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--verify", type=int, default=0, help="trace verifies of a tree of this many nodes instead")
    ap.add_argument("--dump", default="", help="also save each format's raw records (FILE_<fmt>.npz)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    result: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                              "shape": args.shape, "verify_nodes": args.verify, "copy_gbps": round(copy_gbps, 1),
                              "command": "python3 bench/trace_step.py " + " ".join(sys.argv[1:]), "formats": {}}
    for fmt in args.formats.split(","):
        r = trace_format(fmt, SHAPES[args.shape], args.steps + 2, args.pos, copy_gbps, args.verify,
                         f"{args.dump}_{fmt}.npz" if args.dump else "")
        result["formats"][fmt] = r
        print(f"{args.shape} {fmt}: steps {r['step_ms']} ms, {r['launches_per_step']} launches, GEMV ideal "
              f"{r['gemv_ideal_ms_step']} ms")
        for name, v in r["by_kernel"].items():
            print(f"  {name:40s} {json.dumps(v)}")
        cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
