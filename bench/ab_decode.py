"""A/B timing of the engine's CUDA decode step under several settings of the launcher modules, interleaved on one
synthetic model (bench/decode.py's checkpoints), so that the settings are compared under the same weights, the
same device state and the same clocks.

A setting is a list of MODULE.NAME=VALUE assignments (comma separated; settings are ';' separated) applied to the
launcher modules of tandem/backend/cuda, to plan (plan.use_pdl) or to cuda_model (tandem/models/qwen3_5/cuda_model.py),
e.g. gemv.RESNORM_PF=(); VALUE is a Python literal, or a bare string when it does not parse as one.

Each round takes every setting in turn: a fresh state, prefill of --pos tokens, one decode that records the state's
launch plan, warm-up, then the median host wall time of --reps greedy steps (decode, on-device argmax, the id to the
host, as bench/decode.py), and with --verify N[,M...] the median wall time of N-node tree verifies (bench/decode.py's
random_tree). Reports per setting the median over rounds and the ratio to the first setting.

Usage: python3 bench/ab_decode.py --settings "gemv.RESNORM_PF=('nvfp4',);gemv.RESNORM_PF=()" [--shapes 27b,9b]
[--formats nvfp4,fp8] [--rounds 4] [--reps 20] [--pos 128] [--verify 4,8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import LAUNCHERS, SHAPES, build, random_tree, wall_ms  # noqa: E402
from tandem.backend.cuda import argmax, plan  # noqa: E402
from tandem.models.qwen3_5 import cuda_layer_ops, cuda_model  # noqa: E402

# plan.use_pdl: PDL on / off; cuda_layer_ops.ATTN_FUSED / VERIFY_FUSED: the layer loop's choices
MODULES = {m.__name__.rsplit(".", 1)[1]: m for m in (*LAUNCHERS, cuda_model, cuda_layer_ops, plan)}


def parse_setting(text: str) -> list[tuple[Any, str, Any]]:
    """[(module, attribute, value)] of "mod.NAME=VALUE,mod.NAME=VALUE" (empty text: no change).
    Raises: ValueError on an unknown module or attribute."""
    out = []
    for item in filter(None, re.split(r",(?=\s*\w+\.\w+=)", text)):
        target, _, raw = item.partition("=")
        mod_name, _, attr = target.strip().partition(".")
        if mod_name not in MODULES or not hasattr(MODULES[mod_name], attr):
            raise ValueError(f"unknown setting target {target!r}")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out.append((MODULES[mod_name], attr, value))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", required=True, help="';'-separated settings (see the module docstring)")
    ap.add_argument("--shapes", default="27b")
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--verify", default="", help="comma list: also time verifies of trees of these many nodes "
                    "(bench/decode.py random_tree) per setting; empty: decode only")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    settings = args.settings.split(";")
    parsed = [parse_setting(s) for s in settings]
    result: dict[str, Any] = {"command": "python3 bench/ab_decode.py " + " ".join(sys.argv[1:]), "ms": {}}
    for shape in args.shapes.split(","):
        c = SHAPES[shape]
        for fmt in args.formats.split(","):
            m = build(fmt, c)
            prompt = np.random.default_rng(0).integers(0, c["vocab"], args.pos).tolist()
            times: list[list[float]] = [[] for _ in settings]
            sizes = [int(n) for n in args.verify.split(",") if n]
            vtimes: dict[int, list[list[float]]] = {n: [[] for _ in settings] for n in sizes}
            trees = {n: (random_tree(n, n), [int(t) for t in np.random.default_rng(n).integers(0, c["vocab"], n)])
                     for n in sizes}
            for _ in range(args.rounds):
                for k, changes in enumerate(parsed):
                    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in changes]
                    for mod, attr, value in changes:
                        setattr(mod, attr, value)
                    state = None
                    try:
                        state = m.new_state(args.pos + 80)
                        m.prefill(state, prompt)
                        tok = [7]

                        def step() -> None:
                            logits = m.decode(state, tok[0])
                            tok[0] = int(argmax.argmax(logits[None])[0]) % c["vocab"]
                            state.length -= 1  # stay at --pos

                        for _ in range(4):  # the first records the plan
                            step()
                        times[k].append(wall_ms(step, args.reps))
                        for n in sizes:
                            scratch = m.new_tree_scratch(n)
                            st, (parents, ids) = state, trees[n]

                            def verify() -> None:
                                m.verify_tree(st, scratch, ids, parents)

                            for _ in range(3):  # the first records the verify plan
                                verify()
                            vtimes[n][k].append(wall_ms(verify, max(5, args.reps // 4)))
                    finally:
                        for mod, attr, value in saved:
                            setattr(mod, attr, value)
                        cp.get_default_memory_pool().free_all_blocks()
            base = statistics.median(times[0])
            for k, s in enumerate(settings):
                med = statistics.median(times[k])
                key = f"{shape}/{fmt}/{s or 'default'}"
                result["ms"][key] = {"median": round(med, 4), "rounds": [round(t, 4) for t in times[k]]}
                line = f"{key:60s} {med:8.3f} ms  x{med / base:6.3f}  rounds {[round(t, 3) for t in times[k]]}"
                for n in sizes:
                    vmed, vbase = statistics.median(vtimes[n][k]), statistics.median(vtimes[n][0])
                    result["ms"][key][f"verify{n}_median"] = round(vmed, 4)
                    line += f"  verify({n}) {vmed:7.3f} ms x{vmed / vbase:6.3f} ({vmed / med:5.2f} decodes)"
                print(line, flush=True)
            del m
            cp.get_default_memory_pool().free_all_blocks()
    result["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
