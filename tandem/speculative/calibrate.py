"""``tandem calibrate``: measure a device's price curve (verify ms per node count) for StairCut.

Writes profiles/<device>.json: ``{"device": ..., "curves": {<model name>: {"verify_ms": [[N, ms], ...],
"context_tokens": ..., "repeats": ...}}}``; N = 1 is a plain decode step. Other models' curves in the file are
kept. Times are the fastest of ``repeats`` runs (robust to a busy machine) of random mixed-shape trees after a
``context_tokens`` prompt, made non-decreasing in N.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from tandem.models.protocol import SpeculativeModel, synchronizer, tree_verifier
from tandem.speculative.speculator import PROFILES, device_name

NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def measure_curve(model: SpeculativeModel[Any, Any], max_nodes: int = 32, context_tokens: int = 256, repeats: int = 5,
                  seed: int = 0) -> list[tuple[int, float]]:
    """(N, median verify ms) for N in NODE_COUNTS up to ``max_nodes`` (N = 1: ``decode``). A device model's
    ``synchronize`` is called around each timed call (its verbs return before the GPU is done)."""
    sync = synchronizer(model)
    rng = np.random.default_rng(seed)
    vocab = int(model.hp.vocab_size)
    state = model.new_state(context_tokens + max_nodes + 2)
    model.prefill(state, rng.integers(0, vocab, context_tokens).tolist())
    scratch = model.new_tree_scratch(max_nodes)
    saved = model.new_state(state.max_len)
    saved.copy_from(state)
    points = []
    for n in [c for c in NODE_COUNTS if c <= max_nodes]:
        times = []
        for r in range(repeats + 1):  # the first run warms up
            tokens = rng.integers(0, vocab, n).tolist()
            parents = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]
            sync()
            t0 = time.perf_counter()
            if n == 1:
                model.decode(state, tokens[0])
                state.copy_from(saved)
            else:
                model.verify_tree(state, scratch, tokens, parents)
            sync()
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
        points.append((n, float(np.min(times))))  # the least disturbed run
    for j in range(1, len(points)):  # verifying more nodes never costs less: smooth out timing noise
        points[j] = (points[j][0], max(points[j][1], points[j - 1][1]))
    return points


def run_calibrate(model_path: str | None, max_nodes: int = 32, repeats: int = 5, out: str | None = None,
                  device: str = "cpu") -> int:
    """Measure and write the profile of the model on ``device`` ("cpu", "cuda", "auto"); prints the curve.
    Returns the exit status. Raises: ValueError for an unavailable device."""
    from tandem.engine import Engine

    engine = Engine.from_pretrained(model_path, device=device)
    target = tree_verifier(engine.model)
    if target is None:
        raise ValueError("this model's adapter has no verify_tree: no price curve to measure")
    points = measure_curve(target, max_nodes, repeats=repeats)
    device = engine.model.capabilities.profile_device or device_name()
    path = Path(out) if out else PROFILES / f"{device}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    data["device"] = device
    data.setdefault("curves", {})[engine.name] = {"verify_ms": [[n, round(ms, 4)] for n, ms in points],
                                                  "context_tokens": 256, "repeats": repeats}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    for n, ms in points:
        print(f"{n:3d} nodes  {ms:8.3f} ms")
    print(f"wrote {path}")
    return 0
