"""Sum Nsight Compute's per-kernel durations by kernel name: the CSV of
`ncu --metrics gpu__time_duration.sum --csv ...` (e.g. bench/verify_kernels.py --prefill 64) -> a table, longest
first, and with --json a record {kernel: {"us": total, "launches": n}} plus the total in ms.

Usage: python3 tools/ncu_sum.py PROFILE.csv [--json OUT.json] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
from pathlib import Path

US_PER = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernel_us(path: Path) -> tuple[dict[str, float], collections.Counter[str]]:
    """(total µs, launches) per kernel name (template arguments dropped) of an ncu CSV.
    Raises: KeyError on a duration unit it does not know; ValueError on a CSV without ncu's columns."""
    rows = list(csv.reader(line for line in path.read_text().splitlines() if line.startswith('"')))
    head = rows[0]
    ki, ui, vi = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for r in rows[1:]:
        name = re.sub(r"\(.*", "", r[ki])
        total[name] += float(r[vi].replace(",", "")) * US_PER[r[ui]]
        count[name] += 1
    return dict(total), count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    total, count = kernel_us(args.csv)
    ms = sum(total.values()) / 1e3
    print(f"total {ms:.3f} ms, {sum(count.values())} kernels")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{us / 1e3:9.3f} ms {count[name]:6d} x {us / count[name]:9.1f} us  {name}")
    if args.json:
        record = {"total_ms": round(ms, 4), "kernels": {n: {"us": round(v, 1), "launches": count[n]}
                                                        for n, v in sorted(total.items(), key=lambda kv: -kv[1])}}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
