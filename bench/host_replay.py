"""Host time of one replayed decode step: does the host keep ahead of the GPU?

The engine queues each decode step before it reads the id the step before produced (engine._run_ahead), so a
step costs max(host time to queue it, GPU time to run it). This measures the host side of a replayed step on a
synthetic checkpoint (bench/decode.py's): the wall time of `LaunchPlan.replay()` alone, split into its recorded
launches (`cuLaunchKernelEx` through ctypes) and its calls (the launches whose arguments change each step: the
embedding, each attention layer's two kernels), with the GPU idle at the start of each replay (a sync before), so
no launch waits on a full queue. It prints the figures next to the step's GPU time (events around ten
back-to-back replays).
With --verify, the same for replayed verifies of binary trees of those node counts (host: the wall time of
`verify_tree`, its table upload included), and the host wall time of committing a path of up to 3 of their nodes.
With --requests N, the wall time of N greedy requests (a 100-token prompt, then each 40 tokens longer than the last,
as a conversation's turns; 16 new tokens) through an Engine on the
model, plain and with --spec lookup (a repeating prompt), with the engine keeping an ended sequence's state for the
next (its launch plans recorded once) and without (a new state, so a new recording, every request).
Usage: python3 bench/host_replay.py [--shapes 9b,27b] [--formats nvfp4,fp8] [--reps 30] [--verify 4,8]
[--requests 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import SHAPES, build  # noqa: E402
from tandem.backend.cuda import plan as plan_mod  # noqa: E402


def measure(fmt: str, shape: str, reps: int, verify_nodes: list[int], requests: int = 0) -> dict[str, Any]:
    m = build(fmt, SHAPES[shape])
    state = m.new_state(256)
    m.prefill(state, list(range(100)))
    for _ in range(3):  # the first decode records the plan
        m.decode(state, 7)
        state.length -= 1
    p = state.decode_plan
    assert p is not None
    bound = [s for s in p.steps if isinstance(s, plan_mod._Bound)]
    calls = [s for s in p.steps if not isinstance(s, plan_mod._Bound)]
    stream = int(cp.cuda.get_current_stream().ptr)
    replay_us: list[float] = []
    bound_us: list[float] = []
    call_us: list[float] = []
    p.vars["token"], p.vars["pos"] = 7, state.length
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        p.replay()
        replay_us.append((time.perf_counter() - t0) * 1e6)
        cp.cuda.Device().synchronize()
        tb = tc = 0.0
        for s in p.steps:  # the same launches one by one, timed by kind
            t1 = time.perf_counter()
            if isinstance(s, plan_mod._Bound):
                s.launch(stream)
                tb += time.perf_counter() - t1
            else:
                s()
                tc += time.perf_counter() - t1
        bound_us.append(tb * 1e6)
        call_us.append(tc * 1e6)
    cp.cuda.Device().synchronize()
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    ev0.record()
    for _ in range(10):
        p.replay()
    ev1.record()
    ev1.synchronize()
    gpu_ms = cp.cuda.get_elapsed_time(ev0, ev1) / 10
    verify: dict[str, Any] = {}
    for n in verify_nodes:  # a replayed verify of an n-node tree: host wall of verify_tree, GPU time by events
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
        ids = [7] * n
        scratch = m.new_tree_scratch(n)
        for _ in range(3):  # records, then replays
            m.verify_tree(state, scratch, ids, parents)
        host: list[float] = []
        for _ in range(reps):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            m.verify_tree(state, scratch, ids, parents)
            host.append((time.perf_counter() - t0) * 1e6)
        cp.cuda.Device().synchronize()
        vplan = next(p for k, p in state.verify_plans.items() if k[1] == n)
        ev0.record()
        for _ in range(10):
            m.verify_tree(state, scratch, ids, parents)
        ev1.record()
        ev1.synchronize()
        path = [0]
        while 2 * path[-1] + 1 < n and len(path) < 3:  # the first child chain, up to 3 nodes
            path.append(2 * path[-1] + 1)
        commit_host: list[float] = []
        for _ in range(reps):  # commit of a 3-node path after a replayed verify (the state's length restored)
            m.verify_tree(state, scratch, ids, parents)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            m.commit(state, scratch, path)
            commit_host.append((time.perf_counter() - t0) * 1e6)
            cp.cuda.Device().synchronize()
            state.length -= len(path)
        verify[str(n)] = {"host_ms": round(statistics.median(host) / 1e3, 4),
                          "commit_path": len(path), "commit_host_ms": round(statistics.median(commit_host) / 1e3, 4),
                          "calls": sum(not isinstance(s, plan_mod._Bound) for s in vplan.steps),
                          "launches_recorded": sum(isinstance(s, plan_mod._Bound) for s in vplan.steps),
                          "gpu_ms": round(cp.cuda.get_elapsed_time(ev0, ev1) / 10, 4)}
    med = statistics.median
    reqs: dict[str, Any] = {}
    if requests:
        from tandem.engine import Engine
        from tandem.sampling import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        # plain: 100 distinct ids; lookup: a 20-id pattern 5 times, so the lookup drafter proposes trees (random
        # weights accept few of them, but every round verifies a tree and records its size's plan once a state);
        # each request's prompt 40 ids longer than the last, as a conversation's turns
        for spec, prompt in (("off", list(range(1, 101))), ("lookup", list(range(1, 21)) * 5)):
            for keep in (True, False):
                eng = Engine(m, None, None, max_context=512, spec=spec)
                if not keep:
                    eng._keep_state = lambda state: None  # type: ignore[method-assign]
                times = []
                for r in range(requests):
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    eng.complete(prompt + list(range(200, 200 + 40 * r)), params)
                    times.append((time.perf_counter() - t0) * 1e3)
                reqs[f"{spec}_state_{'kept' if keep else 'new'}"] = {
                    "first_ms": round(times[0], 3),
                    "later_median_ms": round(med(times[1:]), 3) if requests > 1 else None}
    r = {"verify": verify, "requests": reqs, "launches_recorded": len(bound), "calls": len(calls),
         "replay_host_ms": round(med(replay_us) / 1e3, 4),
         "recorded_launch_host_us_each": round(med(bound_us) / max(1, len(bound)), 3),
         "call_host_us_each": round(med(call_us) / max(1, len(calls)), 3),
         "gpu_ms_per_step": round(gpu_ms, 4)}
    del m, state, p
    cp.get_default_memory_pool().free_all_blocks()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="9b,27b")
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--verify", default="4", help="node counts of replayed verifies to time ('' for none)")
    ap.add_argument("--requests", type=int, default=0, help="greedy requests through an Engine (0: none)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                           "pdl": plan_mod.pdl_launcher() is not None, "command": " ".join(sys.argv), "shapes": {}}
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            r = measure(fmt, shape, args.reps, [int(v) for v in args.verify.split(",") if v], args.requests)
            res["shapes"].setdefault(shape, {})[fmt] = r
            print(f"{shape} {fmt}: replay host {r['replay_host_ms']} ms ({r['launches_recorded']} recorded launches "
                  f"{r['recorded_launch_host_us_each']} us each, {r['calls']} calls {r['call_host_us_each']} us each); "
                  f"GPU {r['gpu_ms_per_step']} ms a step", flush=True)
            for n, v in r["verify"].items():
                print(f"  verify {n} nodes: host {v['host_ms']} ms ({v['launches_recorded']} recorded launches, "
                      f"{v['calls']} calls); GPU {v['gpu_ms']} ms; commit of {v['commit_path']} nodes: host "
                      f"{v['commit_host_ms']} ms", flush=True)
            for k, v in r["requests"].items():
                print(f"  requests, {k}: first {v['first_ms']} ms, later {v['later_median_ms']} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
