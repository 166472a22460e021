"""Bits per byte by position on held-out text: how the embedded model holds a long context.

The held-out split is tools/train_default_model.py's (files of the CPython standard library whose
sha256(relative path) % 100 < 3), read from the running interpreter's stdlib; the files are concatenated, each
ending with the end-of-text token, into sequences of ``--context`` tokens. Each sequence is prefilled with every
row's logits (``Qwen3_5Model.prefill(all_logits=True)``, in pieces of ``--piece`` tokens so only a piece's logits are
held) and every predicted token's bits are summed into position buckets; bits per byte = bits / UTF-8 bytes of the
predicted tokens.

    python bench/context_bpb.py [--context 32768] [--sequences 1] [--buckets 0,4096,32768]
        [--json bench/results/context_bpb.json]

Not a test (minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.models.qwen3_5.model import Qwen3_5Model  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402

EMBEDDED = ROOT / "tandem" / "assets" / "default"
HELDOUT_PERCENT = 3  # tools/train_default_model.py --heldout-percent's default


def heldout_texts(root: Path) -> list[str]:
    """The held-out files' texts, sorted by relative path (the training tool's split and file filter)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel or "__pycache__" in rel:
            continue
        if int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 >= HELDOUT_PERCENT:
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(text)
    return out


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """[T, V] float32 -> [T, V] float64 natural-log probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(EMBEDDED))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--sequences", type=int, default=1)
    ap.add_argument("--piece", type=int, default=1024)
    ap.add_argument("--buckets", default="0,4096,32768")  # #47: the first 4k positions against the rest
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    edges = [int(x) for x in a.buckets.split(",")]
    tok = Tokenizer.from_dir(a.model)
    assert tok is not None
    model = Qwen3_5Model.load(a.model)
    eot = tok.token_id("<|endoftext|>")
    stream: list[int] = []
    for text in heldout_texts(Path(sysconfig.get_paths()["stdlib"])):
        stream += tok.encode(text) + ([eot] if eot is not None else [])
        if len(stream) >= a.context * a.sequences + 1:
            break
    bits = np.zeros(len(edges) - 1)
    nbytes = np.zeros(len(edges) - 1)
    t0 = time.perf_counter()
    for s in range(a.sequences):
        ids = stream[s * a.context: (s + 1) * a.context + 1]
        state = model.new_state(len(ids))
        for start in range(0, len(ids) - 1, a.piece):
            piece = ids[start: min(start + a.piece, len(ids) - 1)]
            logp = log_softmax_rows(model.prefill(state, piece, all_logits=True))
            targets = np.asarray(ids[start + 1: start + 1 + len(piece)])
            got = -logp[np.arange(len(piece)), targets] / math.log(2)
            for k in range(len(edges) - 1):
                lo, hi = max(edges[k] - start, 0), min(edges[k + 1] - start, len(piece))
                if lo < hi:
                    bits[k] += got[lo:hi].sum()
                    nbytes[k] += sum(len(tok.decode([t]).encode()) for t in targets[lo:hi].tolist())
            print(f"sequence {s} position {start + len(piece)}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows: list[dict[str, Any]] = [
        {"positions": f"{edges[k]}-{edges[k + 1]}", "bits_per_byte": round(float(bits[k] / nbytes[k]), 4),
         "bytes": int(nbytes[k])} for k in range(len(edges) - 1) if nbytes[k]]
    for r in rows:
        print(f"positions {r['positions']:>12}: {r['bits_per_byte']:.4f} bits per byte over {r['bytes']} bytes")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "context": a.context, "sequences": a.sequences,
                                            "rows": rows, "seconds": round(time.perf_counter() - t0, 1)},
                                           indent=1) + "\n")


if __name__ == "__main__":
    main()
