"""Speculative decoding benchmark: tokens per round, draft/verify/commit ms and tok/s with and without speculation.

Four prompt classes (issue 5): code completion, prose-like docstrings, an edit (rewrite a given function with one
change) and a copy. Greedy, raw completion (no chat template). Every speculative run's tokens are checked against
the plain run's. Results go to bench/results/spec_<device>.json.

    python bench/spec.py [--model DIR] [--device cpu|cuda|auto] [--max-tokens 128] [--modes lookup,mtp,auto]
                         [--out FILE]

On the GPU (``--device cuda``) the results go to bench/results/spec_cuda-<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.engine import Engine  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402
from tandem.speculative.speculator import Speculator, device_name  # noqa: E402

FUNC = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

PROMPTS: dict[str, list[str]] = {
    "code": [
        "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n\n    def pop(self):\n",
        "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
    ],
    "docstring": [
        'def parse_header(line):\n    """Parse a header line and return its name and value.\n\n    The line',
        'class Queue:\n    """A first-in, first-out queue.\n\n    Items are',
        '"""Utilities for working with paths.\n\nThis module provides',
    ],
    "edit": [
        "# Original:\n" + FUNC + "\n\n# The same function, with the error message changed to "
        "'window must be > 0':\n" + FUNC.split("\n")[0] + "\n",
        "# Original:\n" + FUNC + "\n\n# The same function, renamed to rolling_mean:\n"
        "def rolling_mean(values, window):\n",
    ],
    "copy": [
        FUNC + "\n\n# An exact copy of the function above:\n" + FUNC.split("\n")[0] + "\n",
        "The Python standard library is very extensive, offering a wide range of facilities. "
        "It contains built-in modules that provide access to system functionality such as file I/O.\n\n"
        "Repeated: The Python standard library is very extensive,",
    ],
}


def run(engine: Engine, prompt: str, max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    done = engine.complete(prompt, params)
    wall = time.perf_counter() - t0
    stats = done.stats.as_dict() if done.stats is not None else {}
    rounds = max(1, stats.get("rounds", 0))
    n = len(done.token_ids)
    return {"token_ids": done.token_ids, "tokens": n, "decode_s": done.decode_s, "wall_s": wall,
            "tok_s": (n - 1) / done.decode_s if done.decode_s > 0 and n > 1 else None,
            "tokens_per_round": stats.get("tokens_per_round"), "nodes_per_round": stats.get("nodes_per_round"),
            "draft_ms_per_round": stats.get("draft_ms", 0.0) / rounds,
            "verify_ms_per_round": stats.get("verify_ms", 0.0) / rounds,
            "commit_ms_per_round": stats.get("commit_ms", 0.0) / rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", default="lookup,mtp,auto", help="speculation modes besides off")
    p.add_argument("--out", default=None, help="default bench/results/spec_<device>.json")
    args = p.parse_args(argv)
    plain = Engine.from_pretrained(args.model, device=args.device)
    configs: list[tuple[str, Engine]] = [("off", plain)]
    for mode in [m for m in args.modes.split(",") if m]:
        try:
            configs.append((mode, Engine(plain.model, plain.tokenizer, plain.chat_template, plain.max_context,
                                         plain.eos_token_ids, plain.name, spec=mode)))
        except ValueError as e:
            print(f"skipping {mode}: {e}")
            continue
        # the same drafters verifying every proposed node (no StairCut): the drafters' own tokens per round
        full = Engine(plain.model, plain.tokenizer, plain.chat_template, plain.max_context, plain.eos_token_ids,
                      plain.name)
        full.speculator = Speculator.for_mode(plain.model, mode, model_name=plain.name)
        if full.speculator is not None:
            full.speculator.policy = "all"
            configs.append((mode + "+all", full))
    results: dict[str, Any] = {}
    for cls, prompts in PROMPTS.items():
        results[cls] = {}
        for name, engine in configs:
            runs = [run(engine, prompt, args.max_tokens) for prompt in prompts]
            if name != "off":
                for r, ref in zip(runs, results[cls]["off"]["_ids"]):
                    assert r["token_ids"] == ref, f"{cls}/{name}: speculative output differs from plain"
            tokens = sum(r["tokens"] for r in runs)
            decode_s = sum(r["decode_s"] for r in runs)
            summary: dict[str, Any] = {
                "tok_s": (tokens - len(runs)) / decode_s if decode_s > 0 else None,
                "tokens_per_round": sum(r["tokens_per_round"] or 0 for r in runs) / len(runs),
                "nodes_per_round": sum(r["nodes_per_round"] or 0 for r in runs) / len(runs),
                "draft_ms_per_round": sum(r["draft_ms_per_round"] for r in runs) / len(runs),
                "verify_ms_per_round": sum(r["verify_ms_per_round"] for r in runs) / len(runs),
                "commit_ms_per_round": sum(r["commit_ms_per_round"] for r in runs) / len(runs),
                "_ids": [r["token_ids"] for r in runs]}
            results[cls][name] = summary
            print(f"{cls:10s} {name:12s} tok/s {summary['tok_s'] or 0:8.1f}  tokens/round "
                  f"{summary['tokens_per_round']:5.2f}  nodes/round {summary['nodes_per_round']:5.2f}  "
                  f"draft {summary['draft_ms_per_round']:6.2f} ms  verify {summary['verify_ms_per_round']:6.2f} ms  "
                  f"commit {summary['commit_ms_per_round']:6.2f} ms", flush=True)
    for cls in results:
        for name in results[cls]:
            results[cls][name].pop("_ids")
    device = getattr(plain.model, "profile_device", None) or device_name()
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"spec_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device, "machine": platform.machine(), "model": plain.name, "max_tokens": args.max_tokens,
        "command": "python bench/spec.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
