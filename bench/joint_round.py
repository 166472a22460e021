"""Where a joint round's time goes (``--parallel`` slots: tandem/slots.py ``JointRounds``,
tandem/models/qwen3_5/cuda_joint.py): the same synthetic model timed at four levels, so the gap between the
server's time a token and the weights' floor can be assigned.

1. ``decode``: one sequence's decode step (its recorded plan), and a verify of ``--verify-nodes`` nodes of one
   sequence (the same GEMV rows as that many slots' decode rows).
2. ``joint``: ``joint_forward`` of R decode items (R sequences, host ids), called directly: the host time to queue
   the pass, its device time (CUDA events around it) and the wall time with a sync.
3. ``engine``: an ``Engine(parallel=max R)`` on the same model, R threads each generating ``--max-tokens`` greedy
   tokens (``ignore_eos``) from its own prompt, no HTTP: each stream's time a token, and each joint pass as the
   rounds run it (host time inside the pass, device time by events, the period between passes, the items a pass).
4. ``sampled``: where the threads' host time goes during level 3 at the largest R: a sampler thread reads every
   thread's innermost frame each millisecond (a thread in ``threading.wait`` counts as waiting) and counts the
   functions of the threads that were running.

    python3 bench/joint_round.py [--shape 27b] [--format nvfp4] [--slots 1,8,16] [--prompt-tokens 1024]
        [--max-tokens 64] [--verify-nodes 16] [--out bench/results/joint_round_X.json]

Needs a GPU (CuPy); the model is bench/decode.py's ``build`` with a head whose rows past the embedded tokenizer
are zero, as bench/synthetic_server.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from decode import SHAPES, build, random_tree, wall_ms  # noqa: E402
from synthetic_server import zero_rows_head  # noqa: E402
from tandem.chat import ChatTemplate  # noqa: E402
from tandem.engine import DEFAULT_MODEL, Engine  # noqa: E402
from tandem.models.protocol import JointItem  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402


def _ms(a: Any, b: Any) -> float:
    return float(cp.cuda.get_elapsed_time(a, b))


def timed_pass(fn: Any) -> tuple[float, float, float]:
    """(host ms to queue, device ms between events around it, wall ms to its end) of one call of fn()."""
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    t1 = time.perf_counter()
    end.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, _ms(start, end), (t2 - t0) * 1e3


def medians(rows: list[tuple[float, float, float]]) -> dict[str, float]:
    host, device, wall = zip(*rows)
    return {"host_ms": round(statistics.median(host), 3), "device_ms": round(statistics.median(device), 3),
            "wall_ms": round(statistics.median(wall), 3)}


def level_decode(m: Any, prompt: list[int], nodes: int, vocab: int) -> dict[str, Any]:
    """One sequence: a decode step (pipelined, and timed alone) and a verify of ``nodes`` nodes."""
    state = m.new_state(len(prompt) + 256)
    m.prefill(state, prompt)

    def step() -> None:
        m.decode(state, 7)
        state.length -= 1

    for _ in range(3):
        step()
    alone = medians([timed_pass(step) for _ in range(20)])

    def steps10() -> None:
        for _ in range(10):
            step()

    pipelined = wall_ms(steps10, 5) / 10
    parents = random_tree(nodes, nodes)
    scratch = m.new_tree_scratch(nodes)
    ids = [int(t) for t in np.random.default_rng(nodes).integers(0, vocab, nodes)]
    m.verify_tree(state, scratch, ids, parents)
    verify = medians([timed_pass(lambda: m.verify_tree(state, scratch, ids, parents)) for _ in range(10)])
    return {"decode": alone, "decode_pipelined_ms": round(pipelined, 3), f"verify{nodes}": verify}


def level_joint(m: Any, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """joint_forward of len(prompts) decode items, each on its own state, ``steps`` passes after 3 to warm."""
    states = []
    for p in prompts:
        s = m.new_state(len(p) + steps + 16)
        m.prefill(s, p)
        states.append(s)
    m.release_joint_plans()
    tokens = [7] * len(states)

    def one() -> None:
        m.joint_forward([JointItem(s, [t]) for s, t in zip(states, tokens)])

    for _ in range(3):
        one()
    rows = [timed_pass(one) for _ in range(steps)]
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    cp.cuda.Device().synchronize()
    pipelined = (time.perf_counter() - t0) * 1e3 / steps
    m.release_joint_plans()
    del states
    cp.get_default_memory_pool().free_all_blocks()
    return {**medians(rows), "pipelined_ms": round(pipelined, 3)}


class FrameSampler:
    """Every ``period_s``, each live thread's innermost frame (function, file:line), counted; waits counted apart."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.running: collections.Counter[str] = collections.Counter()
        self.tandem: collections.Counter[str] = collections.Counter()
        self.waiting = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period_s):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                self.samples += 1
                code = frame.f_code
                if code.co_name in ("wait", "_wait_for_tstate_lock", "join") \
                        and code.co_filename.endswith("threading.py"):
                    self.waiting += 1
                    continue
                self.running[f"{code.co_name} {Path(code.co_filename).name}:{frame.f_lineno}"] += 1
                f: Any = frame
                while f is not None:  # the innermost tandem frame: which of the engine's steps the thread is in
                    if "/tandem/" in f.f_code.co_filename:
                        self.tandem[f"{f.f_code.co_name} {Path(f.f_code.co_filename).name}:{f.f_lineno}"] += 1
                        break
                    f = f.f_back

    def report(self, top: int = 20) -> dict[str, Any]:
        return {"samples": self.samples, "waiting": self.waiting,
                "running_innermost": self.running.most_common(top), "running_tandem": self.tandem.most_common(top)}


def level_engine(engine: Engine, prompts: list[list[int]], max_tokens: int, sample: bool) -> dict[str, Any]:
    """len(prompts) threads generating at once through the engine's slots; each joint pass timed."""
    rounds = engine.rounds
    assert rounds is not None
    passes: list[tuple[float, float, int, Any, Any]] = []  # (host start s, host end s, items, start ev, end ev)
    run = rounds.run

    def timed_run(items: list[Any]) -> list[Any]:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        start.record()
        out = run(items)
        end.record()
        passes.append((t0, time.perf_counter(), len(items), start, end))
        return out

    rounds.run = timed_run
    arrivals: list[list[float]] = [[] for _ in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    go = threading.Barrier(len(prompts))

    def worker(k: int) -> None:
        go.wait()
        for chunk in engine.generate(prompts[k], params):
            arrivals[k] += [time.perf_counter()] * len(chunk.token_ids)

    sampler = FrameSampler() if sample else None
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(prompts))]
    if sampler is not None:
        sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sampler is not None:
        sampler.stop()
    rounds.run = run
    cp.cuda.Device().synchronize()
    per_token = [(a[-1] - a[0]) / (len(a) - 1) * 1e3 for a in arrivals if len(a) > 1]
    last_first = max(a[0] for a in arrivals)
    first_end = min(a[-1] for a in arrivals)
    window = sum(sum(1 for t in a if last_first < t <= first_end) for a in arrivals)
    full = [p for p in passes if p[2] == len(prompts) and last_first < p[0] < first_end]
    out: dict[str, Any] = {
        "tokens": [len(a) for a in arrivals],
        "time_a_token_ms_median": round(statistics.median(per_token), 3),
        "decode_tok_s": round(window / max(first_end - last_first, 1e-9), 1),
        "passes": len(passes), "items_a_pass": round(sum(p[2] for p in passes) / max(1, len(passes)), 2),
    }
    if len(full) > 2:
        period = [(b[0] - a[0]) * 1e3 for a, b in zip(full, full[1:])]
        out["full_passes"] = {
            "count": len(full),
            "period_ms": round(statistics.median(period), 3),
            "host_in_pass_ms": round(statistics.median((p[1] - p[0]) * 1e3 for p in full), 3),
            "device_ms": round(statistics.median(_ms(p[3], p[4]) for p in full), 3),
        }
        full_passes = out["full_passes"]
        full_passes["device_idle_ms"] = round(full_passes["period_ms"] - full_passes["device_ms"], 3)
    if sampler is not None:
        out["sampled"] = sampler.report()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    ap.add_argument("--format", default="nvfp4", choices=("nvfp4", "fp8", "bf16"))
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--slots", default="1,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--joint-steps", type=int, default=20)
    ap.add_argument("--verify-nodes", type=int, default=16)
    ap.add_argument("--levels", default="decode,joint,engine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    levels = set(args.levels.split(","))
    tok = Tokenizer.from_dir(DEFAULT_MODEL)
    template = ChatTemplate.from_dir(DEFAULT_MODEL)
    assert tok is not None and template is not None
    shape = SHAPES[args.shape]
    t0 = time.perf_counter()
    cp.random.seed(0)
    m = build(args.format, shape, args.kv_dtype)
    vocab = min(tok.vocab_size, shape["vocab"])  # the head's live rows, and the prompts' ids
    m.head = zero_rows_head(args.format, shape["vocab"], shape["hidden"], vocab)
    cp.get_default_memory_pool().free_all_blocks()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(max(slots))]
    result: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                              "shape": args.shape, "format": args.format, "kv_dtype": args.kv_dtype,
                              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                              "command": "python3 " + " ".join(sys.argv), "build_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result), flush=True)
    if "decode" in levels:
        result["decode"] = level_decode(m, prompts[0], args.verify_nodes, vocab)
        print("decode", json.dumps(result["decode"]), flush=True)
    if "joint" in levels:
        result["joint"] = {}
        for r in slots:
            result["joint"][str(r)] = level_joint(m, prompts[:r], args.joint_steps)
            print("joint", r, json.dumps(result["joint"][str(r)]), flush=True)
    if "engine" in levels:
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        engine = Engine(m, tok, template, args.prompt_tokens + args.max_tokens + 64, eos, "synthetic", "off", None,
                        1024, max(slots))
        engine.warm_up()
        result["engine"] = {}
        level_engine(engine, prompts[:2], 8, False)  # the first joint rounds (their plan recordings) untimed
        for r in slots:
            result["engine"][str(r)] = level_engine(engine, prompts[:r], args.max_tokens, r == max(slots))
            print("engine", r, json.dumps(result["engine"][str(r)]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
