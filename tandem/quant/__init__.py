"""Quantisation of checkpoints (NVFP4, FP8) with an activation-weighted clip search, and its calibration."""

from tandem.quant.calib import activation_mean_squares, calibration_tokens
from tandem.quant.quantize import TARGETS, QuantizeReport, bytes_per_step, quantize_checkpoint
from tandem.quant.search import DEFAULT_CLIPS

__all__ = ["DEFAULT_CLIPS", "TARGETS", "QuantizeReport", "activation_mean_squares", "bytes_per_step",
           "calibration_tokens", "quantize_checkpoint"]
