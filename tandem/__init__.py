"""Tandem: an inference engine for the Qwen3.5 hybrid Gated-DeltaNet/attention models.

The importable surface is :class:`Engine` (tandem/engine.py) and :class:`SamplingParams` (tandem/sampling.py),
both importable from here: ``from tandem import Engine, SamplingParams``. They load on first use, so importing a
submodule (``tandem.config``, say) does not pull in the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tandem.engine import Engine
    from tandem.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    """``Engine`` and ``SamplingParams`` on first access (PEP 562). Raises AttributeError for any other name."""
    if name == "Engine":
        from tandem.engine import Engine

        return Engine
    if name == "SamplingParams":
        from tandem.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
