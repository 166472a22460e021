"""Speculative decoding at Qwen3.5-27B's and -9B's shapes (and the MoE shapes 35b-a3b, 80b-a3b of
bench/moe_decode.py) on the GPU, with drafts of a chosen quality.

Random weights (bench/decode.py's synthetic checkpoints, generated on the device) give no drafter anything to
learn, so the drafts come from an oracle: the plain greedy continuation, computed first, each guess replaced by a
random id with probability ``corrupt`` (the chain goes on below a wrong guess, whose subtree is then rejected).
That isolates what the engine does with a draft of a given quality at full scale: StairCut's tree size, the
verify and commit, the rounds' host work. Every output (each request's, the first ones too) is checked against the
plain one (exactness at these shapes); a run that differs is reported and the script exits 1.

For each shape, format and ``corrupt``: plain greedy tok/s (the engine's run-ahead loop), speculative tok/s, tokens
and nodes a round, mean draft / verify / commit ms a round, and the launch plans recorded in each request. Each
configuration runs on a fresh engine: its first request is reported apart (``cold_tok_s``: every launch plan it needs
recorded in it, the speculator's price scales and acceptance estimates starting from the profile and the prior),
then ``--reps`` more (``tok_s``: the median of those that recorded no plan, else of all; ``tok_s_each`` lists every
request's; round figures from the last): the engine keeps the state, so their plans replay, and the speculator keeps
what it learned in the requests before (its estimates, the oracle's noise generator going on). A warm request can
still record a plan for a tree size or commit length it meets first (``recordings``, per request). tok/s = (tokens -
1) / the time after the first token, for plain and speculative alike. ``--no-borrow`` (an A/B switch) gives the
acceptance estimates without borrowing: a depth no guess was tested at keeps the prior instead of taking the
deepest tested depth's averages.
Usage: python3 bench/spec_scale.py [--shapes 27b,9b,35b-a3b] [--formats nvfp4,fp8] [--corrupt 0,0.1,0.3] [--depth 8]
[--tokens 96] [--reps 3] [--no-borrow] [--out FILE.json]
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

from bench import moe_decode  # noqa: E402
from bench.decode import SHAPES, build  # noqa: E402
from tandem.engine import Engine  # noqa: E402
from tandem.speculative.acceptance import AcceptanceStats  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.speculative.speculator import Speculator  # noqa: E402
from tandem.speculative.tree import Fragment  # noqa: E402

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


def requests(engine: Engine, model: Any, params: SamplingParams, reps: int,
             want: list[int] | None) -> dict[str, Any]:
    """1 + ``reps`` requests of PROMPT on ``engine``: the first one's tok/s (cold), the median of the others' (warm),
    the plans each recorded, whether every output equals ``want`` (None: the first output, checked against the
    others), the first output and the last request's stats."""
    rates, recorded, outputs = [], [], []
    for _ in range(1 + reps):
        before = model.plan_recordings
        cp.cuda.Device().synchronize()
        out = engine.complete(PROMPT, params)
        recorded.append(model.plan_recordings - before)
        outputs.append(out.token_ids)
        rates.append((len(out.token_ids) - 1) / out.decode_s if out.decode_s > 0 else float("nan"))
    ref = outputs[0] if want is None else want
    clean = [r for r, n in zip(rates[1:], recorded[1:]) if n == 0] or rates[1:]  # warm requests that recorded none
    return {"cold_tok_s": round(rates[0], 2), "tok_s": round(float(statistics.median(clean)), 2),
            "tok_s_each": [round(r, 2) for r in rates], "recordings": recorded,
            "equal": all(o == ref for o in outputs), "output": outputs[0], "stats": engine.last_stats}


def measure(fmt: str, shape: str, corrupts: list[float], depth: int, tokens: int, reps: int) -> dict[str, Any]:
    m = moe_decode.build(fmt, moe_decode.SHAPES[shape]) if shape in moe_decode.SHAPES else build(fmt, SHAPES[shape])
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    plain = Engine(m, None, None, max_context=512)
    base = requests(plain, m, params, reps, None)
    want, plain_rate = base["output"], base["tok_s"]
    res: dict[str, Any] = {"shape": shape, "format": fmt, "tokens": tokens, "plain_tok_s": plain_rate,
                           "plain_tok_s_each": base["tok_s_each"],
                           "plain_cold_tok_s": base["cold_tok_s"], "plain_equal": base["equal"], "spec": []}
    print(f"{shape} {fmt}: plain {plain_rate:.1f} tok/s (first request {base['cold_tok_s']:.1f}), repeatable "
          f"{base['equal']}", flush=True)
    for c in corrupts:
        eng = Engine(m, None, None, max_context=512)
        eng.speculator = Speculator(m, [NoisyOracle(want, int(m.hp.vocab_size), depth, c)], max_nodes=32)
        got = requests(eng, m, params, reps, want)
        rounds = got["stats"].rounds
        tree_rounds = [r for r in rounds if r.num_nodes > 1]

        def mean(vals: list[float]) -> float:
            return round(float(np.mean(vals)), 3) if vals else 0.0

        r = {"corrupt": c, "depth": depth, "tok_s": got["tok_s"], "speedup": round(got["tok_s"] / plain_rate, 3),
             "cold_tok_s": got["cold_tok_s"], "tok_s_each": got["tok_s_each"], "recordings": got["recordings"],
             "equal": got["equal"],
             "rounds": len(rounds), "tree_rounds": len(tree_rounds),
             "tokens_per_round": mean([x.num_tokens for x in rounds]),
             "nodes_per_tree_round": mean([x.num_nodes for x in tree_rounds]),
             "tokens_per_tree_round": mean([x.num_tokens for x in tree_rounds]),
             "draft_ms": mean([x.draft_ms for x in rounds]), "verify_ms_tree": mean([x.verify_ms for x in tree_rounds]),
             "commit_ms_tree": mean([x.commit_ms for x in tree_rounds])}
        res["spec"].append(r)
        print(f"  corrupt {c}: {got['tok_s']:.1f} tok/s ({r['speedup']}x plain; first request {got['cold_tok_s']:.1f}),"
              f" equal {r['equal']}, plans recorded {got['recordings']}, {r['tokens_per_round']} tokens a round, tree "
              f"rounds {len(tree_rounds)}/{len(rounds)} ({r['nodes_per_tree_round']} nodes, "
              f"{r['tokens_per_tree_round']} tokens, verify {r['verify_ms_tree']} ms, commit {r['commit_ms_tree']} ms)",
              flush=True)
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
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-borrow", action="store_true", help="untested depths keep the prior (the old estimates)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.no_borrow:
        AcceptanceStats._source_slot = lambda self, source, s: s  # type: ignore[method-assign]
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    results: dict[str, Any] = {"device": name, "command": " ".join(sys.argv), "borrow": not args.no_borrow,
                               "runs": []}
    corrupts = [float(v) for v in args.corrupt.split(",") if v]
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            results["runs"].append(measure(fmt, shape, corrupts, args.depth, args.tokens, args.reps))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if not all(r["equal"] for run in results["runs"] for r in run["spec"]) or \
            not all(run["plain_equal"] for run in results["runs"]):
        print("a speculative output differed from the plain one")
        sys.exit(1)


if __name__ == "__main__":
    main()
