"""Write a GPU's StairCut price profile (profiles/<device>.json, tandem/speculative/calibrate.py's format) from a
bench/decode.py result: for each synthetic shape and format, verify ms at N = 1 (the engine's decode step) and at
each measured tree size (the engine's verify_tree wall time, ratio × decode ms), made non-decreasing in N as
calibrate does. The curves are priors for models of those shapes: `tandem calibrate --device cuda` measures a real
checkpoint's curve into the same file, and the engine rescales any curve online.

python3 tools/profile_from_bench.py bench/results/cuda_decode_h200.json [--first 27b/nvfp4] [--out PATH]
(--first: the curve listed first, which a model without its own curve takes.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tandem.models.qwen3_5.cuda_model import profile_key_for  # noqa: E402  (the engine's own key)


def curves_from_bench(result: dict[str, Any], first: str) -> dict[str, Any]:
    """{"synthetic-qwen3.5-<shape>-<fmt>": {"verify_ms": [[N, ms], ...], "source": ...}}, ``first`` ("27b/nvfp4")
    first. Raises KeyError for a result without decode / verify figures."""
    curves: dict[str, Any] = {}
    for shape, block in result["shapes"].items():
        for fmt, r in block["formats"].items():
            decode = float(r["ms_per_token_engine"])
            points = [(1, decode)] + sorted((int(n), ratio * decode) for n, ratio in
                                            r["verify_over_decode_engine"].items())
            for j in range(1, len(points)):  # verifying more nodes never costs less (as calibrate)
                points[j] = (points[j][0], max(points[j][1], points[j - 1][1]))
            curves[f"{shape}/{fmt}"] = {"verify_ms": [[n, round(ms, 4)] for n, ms in points],
                                        "source": f"{result['command']} (synthetic checkpoint, position "
                                                  f"{result.get('pos', 128)}, {result['device']})"}
    order = sorted(curves, key=lambda k: (k != first, k))
    return {f"synthetic-qwen3.5-{k.replace('/', '-')}": curves[k] for k in order}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--first", default="27b/nvfp4")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    result = json.loads(Path(args.result).read_text())
    device = profile_key_for(str(result["device"]))
    path = Path(args.out) if args.out else REPO / "profiles" / f"{device}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    data["device"] = device
    kept = {k: v for k, v in data.get("curves", {}).items() if not k.startswith("synthetic-")}
    data["curves"] = {**curves_from_bench(result, args.first), **kept}
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}: {', '.join(data['curves'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
