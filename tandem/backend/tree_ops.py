"""NumPy ops over a draft tree's nodes (tandem/speculative/tree.py: ``parent_ids[i] < i``, -1 for the root) that the
host verify (tandem/models/qwen3_5/verify.py) and the CUDA kernels' references (tandem/backend/cuda/gdn_seq.py) share.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

F32 = np.float32


def tree_windows(tail: np.ndarray, pre: np.ndarray, parent_ids: Sequence[int]) -> np.ndarray:
    """Conv windows [N, K, C]: each node's last K-1 path rows (entry tail, then ancestors), then its own row."""
    km1 = tail.shape[0]
    n = len(parent_ids)
    win = np.empty((n, km1 + 1, tail.shape[1]), F32)
    for i in range(n):
        win[i, km1] = pre[i]
        j, a = km1 - 1, parent_ids[i]
        while j >= 0 and a >= 0:
            win[i, j] = pre[a]
            j, a = j - 1, parent_ids[a]
        if j >= 0:
            win[i, :j + 1] = tail[km1 - 1 - j:]
    return win
