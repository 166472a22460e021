"""Summarise tools/gpu_check.sh's figures: the worst relative error and row-invariance result per kernel test.

Usage: python3 tools/gpu_check.py OUT_DIR (reads OUT_DIR/kernel_figures.jsonl, prints a table).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    path = Path(sys.argv[1]) / "kernel_figures.jsonl"
    if not path.is_file():
        print(f"no figures at {path}")
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        figs = {k: v for k, v in r.items() if k not in ("test", "seed", "rows")}
        text = "  ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in figs.items())
        print(f"{r['test']:48s} {text}")


if __name__ == "__main__":
    main()
