"""Tandem: an inference engine for the Qwen3.5 hybrid Gated-DeltaNet/attention models.

The importable surface is :class:`tandem.engine.Engine` and :class:`tandem.sampling.SamplingParams`.
"""

__version__ = "0.1.0"
