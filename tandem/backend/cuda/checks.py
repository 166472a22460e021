"""Error metrics and the figure log shared by the CUDA kernel tests (NumPy only; METHOD.md's metric).

`rel_error` is ‖out − ref‖ / ‖ref‖ in float64; `max_rel_error` is max |out − ref| / max |ref|. A NaN in `out`
(an unwritten element of a NaN-poisoned output) makes both infinite. `record` appends a JSON line of figures to
the file named by TANDEM_CUDA_REPORT (tools/gpu_check.sh sets it), so the check's numbers survive the run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖₂ / ‖ref‖₂ (float64); inf if out holds a NaN or inf."""
    o = np.asarray(out, np.float64)
    r = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf")
    return float(np.linalg.norm(o - r) / max(float(np.linalg.norm(r)), 1e-30))


def max_rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out − ref| / max |ref| (float64); inf if out holds a NaN or inf."""
    o = np.asarray(out, np.float64)
    r = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf")
    return float(np.max(np.abs(o - r)) / max(float(np.max(np.abs(r))), 1e-30)) if r.size else 0.0


def record(test: str, **figures: Any) -> None:
    """Append {"test": test, **figures} to $TANDEM_CUDA_REPORT (no-op when unset)."""
    path = os.environ.get("TANDEM_CUDA_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": test, **figures}, default=float) + "\n")
