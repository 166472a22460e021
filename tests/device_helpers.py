"""Helpers for the model tests (tests/test_cuda_engine.py, tests/test_cuda_verify_fused.py, tests/test_spec_verify.py):
plain decodes of a token list, a node's root path in a draft tree, and the exact comparison of two states (host or
device)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np


def plain_decodes(model: Any, prompt: list[int], tokens: list[int]) -> tuple[Any, Any]:
    """A fresh state after prefill(prompt) and one decode per token: (state, the last decode's logits)."""
    state = model.new_state(len(prompt) + len(tokens) + 1)
    model.prefill(state, prompt)
    logits = None
    for t in tokens:
        logits = model.decode(state, t)
    return state, logits


def root_path(parents: list[int], node: int) -> list[int]:
    """The nodes from the root (parent -1) down to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def assert_states_equal(state: Any, ref: Any) -> None:
    """``state`` (a ModelState or DeviceState) has ``ref``'s length and exactly its buffers (np.array_equal: a NaN
    anywhere fails; a view buffer's rows below the length only)."""
    assert state.length == ref.length
    for spec in ref.specs:
        a, b = state.buffers[spec.name], ref.buffers[spec.name]
        if spec.kind == "view":
            a, b = a[:ref.length], b[:ref.length]
        assert np.array_equal(_host(a), _host(b)), f"buffer {spec.name} differs"


def _host(a: Any) -> np.ndarray:
    """A device (CuPy) or host array as a NumPy array."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


@contextlib.contextmanager
def decode_bits_prefill(model: Any) -> Iterator[None]:
    """The CUDA model's prefill with decode's arithmetic inside the block (``TC_PREFILL`` off: the fallback path,
    where a prefilled state equals a decoded one bit for bit); the tensor-core prefill again after it."""
    model.TC_PREFILL = False
    try:
        yield
    finally:
        del model.TC_PREFILL
