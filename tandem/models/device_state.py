"""A sequence's state in device memory: the same sections and views as ``ModelState``, as CuPy arrays.

Layout: exactly ``ModelState``'s (DESIGN.md, "State: sections and views"), one C-contiguous device array per
``BufferSpec``; every buffer is allocated once, when the sequence starts, and written in place by prefill, decode
and commit. The signature is ``ModelState``'s (``spec_signature``), so a cache may copy a host state into a device
state of the same model and back. CuPy is imported on construction only.
"""

from __future__ import annotations

from typing import Any

from tandem.backend.cuda.loader import cupy
from tandem.models.state import (BufferSpec, allocate_buffers, check_specs, copy_state, reset_state, spec_signature,
                                 state_nbytes)


class DeviceState:
    """The buffers of one sequence on the GPU (the attributes and methods of ``ModelState``).

    Attributes:
        specs: the buffer specs, in a fixed order.
        buffers: name -> preallocated cupy.ndarray (zeroed).
        length: number of committed tokens. max_len: capacity of the views in tokens.
    Raises: ValueError as ``ModelState`` (max_len < 1, a bad kind, a view not sized max_len); ImportError
    without CuPy.
    """

    def __init__(self, specs: list[BufferSpec], max_len: int) -> None:
        cp = cupy()
        check_specs(specs, max_len)
        self.specs = list(specs)
        self.max_len = max_len
        self.length = 0
        self.decode_plan: Any = None  # the model's recorded decode launches over these buffers (plan.LaunchPlan)
        self.verify_plans: dict[Any, Any] = {}  # recorded tree verifies, per (scratch, node count)
        self.commit_plans: dict[Any, Any] = {}  # recorded commits, per (scratch, path length)
        self.token_reader: Any = None  # on-device chosen ids (token_reader.TokenReader), from choose_on_device
        self.multimodal: Any = None  # an image prompt's rows (models/qwen3_5/mrope.py), set per sequence
        self.buffers: dict[str, Any] = allocate_buffers(self.specs, cp.zeros)

    @property
    def signature(self) -> str:
        """``ModelState``'s signature of the same specs."""
        return spec_signature(self.specs)

    def nbytes(self) -> int:
        """Device bytes held by all buffers (allocated capacity)."""
        return state_nbytes(self)

    def reset(self) -> None:
        """Zero every buffer in place and set length to 0 (a new sequence: its chosen ids, penalty counts and image
        rows start over too)."""
        reset_state(self)
        self.token_reader = None
        self.multimodal = None

    def copy_from(self, other: Any) -> None:
        """Copy ``other``'s sections and the used rows of its views into this state, in place.

        Args: other: a ``DeviceState`` (device-to-device copies) or a host ``ModelState`` (uploads).
        Raises: ValueError: the signatures differ or ``other`` is longer than this state's views.
        """
        copy_state(self, other, cupy().asarray)

    def to_host(self, out: Any) -> None:
        """Copy this state into a host ``ModelState`` ``out`` of the same specs (sections, used view rows).

        Raises: ValueError: the signatures differ or this state does not fit ``out``.
        """
        copy_state(out, self, cupy().asnumpy)
