"""Speculative decoding at Qwen3.5-27B's and -9B's shapes on the GPU, with drafts of a chosen quality.

Random weights (bench/decode.py's synthetic checkpoints, generated on the device) give no drafter anything to
learn, so the drafts come from an oracle: the plain greedy continuation, computed first, each guess replaced by a
random id with probability ``corrupt`` (the chain goes on below a wrong guess, whose subtree is then rejected).
That isolates what the engine does with a draft of a given quality at full scale: StairCut's tree size, the
verify and commit, the rounds' host work. Every speculative output is checked against the plain one (exactness at
these shapes); a run that differs is reported and the script exits 1.

For each shape, format and ``corrupt``: plain greedy tok/s (the engine's run-ahead loop), speculative tok/s, tokens
and nodes a round, mean draft / verify / commit ms a round. Each configuration runs one request untimed (its plans
recorded; the engine keeps the state for the next request) and then ``--reps`` timed ones.
Usage: python3 bench/spec_scale.py [--shapes 27b,9b] [--formats nvfp4,fp8] [--corrupt 0,0.1,0.3] [--depth 8]
[--tokens 96] [--reps 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from bench.decode import SHAPES, build  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.spec.speculator import Speculator  # noqa: E402
from tandem.spec.tree import Fragment  # noqa: E402

PROMPT = list(range(1000, 1100))  # 100 ids


class NoisyOracle:
    """Drafts the known plain continuation ``output`` as a chain of ``depth`` guesses, each replaced by a random id
    with probability ``corrupt`` (confidence 0.9 for every guess: StairCut learns the acceptance online)."""

    name = "oracle"
    needs_hidden = False

    def __init__(self, output: list[int], vocab: int, depth: int, corrupt: float, seed: int = 0) -> None:
        self.output, self.vocab, self.depth, self.corrupt = output, vocab, depth, corrupt
        self.rng = np.random.default_rng(seed)
        self.done = 0

    def reset(self, ids: list[int], hidden: Any = None, max_len: int = 0) -> None:
        self.done = 0

    def extend(self, ids: list[int], hidden: Any = None) -> None:
        self.done += len(ids)

    def propose(self, root: int, max_nodes: int, max_depth: int) -> Fragment:
        frag = Fragment()
        parent = -1
        for tok in self.output[self.done + 1:self.done + 1 + min(self.depth, max_depth, max_nodes)]:
            guess = int(self.rng.integers(0, self.vocab)) if self.rng.random() < self.corrupt else tok
            parent = frag.add(parent, guess, 0.9)
        return frag


def timed(engine: Engine, params: SamplingParams, reps: int) -> tuple[list[int], float, Any]:
    """One untimed request, then ``reps`` timed ones: (ids, median decode tok/s after the first token, stats)."""
    out = engine.complete(PROMPT, params)
    rates = []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        out = engine.complete(PROMPT, params)
        rates.append((len(out.token_ids) - 1) / out.decode_s if out.decode_s > 0 else float("nan"))
    return out.token_ids, float(statistics.median(rates)), engine.last_stats


def measure(fmt: str, shape: str, corrupts: list[float], depth: int, tokens: int, reps: int) -> dict[str, Any]:
    m = build(fmt, SHAPES[shape])
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    plain = Engine(m, None, None, max_context=512)
    want, plain_rate, _ = timed(plain, params, reps)
    res: dict[str, Any] = {"shape": shape, "format": fmt, "tokens": tokens, "plain_tok_s": round(plain_rate, 2),
                           "spec": []}
    print(f"{shape} {fmt}: plain {plain_rate:.1f} tok/s", flush=True)
    for c in corrupts:
        eng = Engine(m, None, None, max_context=512)
        eng.speculator = Speculator(m, [NoisyOracle(want, int(m.hp.vocab_size), depth, c)], max_nodes=32)
        got, rate, stats = timed(eng, params, reps)
        rounds = stats.rounds
        tree_rounds = [r for r in rounds if r.num_nodes > 1]

        def mean(vals: list[float]) -> float:
            return round(float(np.mean(vals)), 3) if vals else 0.0

        r = {"corrupt": c, "depth": depth, "tok_s": round(rate, 2), "speedup": round(rate / plain_rate, 3),
             "equal": got == want, "rounds": len(rounds), "tree_rounds": len(tree_rounds),
             "tokens_per_round": mean([x.num_tokens for x in rounds]),
             "nodes_per_tree_round": mean([x.num_nodes for x in tree_rounds]),
             "tokens_per_tree_round": mean([x.num_tokens for x in tree_rounds]),
             "draft_ms": mean([x.draft_ms for x in rounds]), "verify_ms_tree": mean([x.verify_ms for x in tree_rounds]),
             "commit_ms_tree": mean([x.commit_ms for x in tree_rounds])}
        res["spec"].append(r)
        print(f"  corrupt {c}: {rate:.1f} tok/s ({r['speedup']}x plain), equal {r['equal']}, "
              f"{r['tokens_per_round']} tokens a round, tree rounds {len(tree_rounds)}/{len(rounds)} "
              f"({r['nodes_per_tree_round']} nodes, {r['tokens_per_tree_round']} tokens, verify "
              f"{r['verify_ms_tree']} ms, commit {r['commit_ms_tree']} ms)", flush=True)
    del m, plain
    cp.get_default_memory_pool().free_all_blocks()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="27b,9b")
    ap.add_argument("--formats", default="nvfp4,fp8")
    ap.add_argument("--corrupt", default="0,0.1,0.3")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    results: dict[str, Any] = {"device": name, "command": " ".join(sys.argv), "runs": []}
    corrupts = [float(v) for v in args.corrupt.split(",") if v]
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            results["runs"].append(measure(fmt, shape, corrupts, args.depth, args.tokens, args.reps))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if not all(r["equal"] for run in results["runs"] for r in run["spec"]):
        print("a speculative output differed from the plain one")
        sys.exit(1)


if __name__ == "__main__":
    main()
