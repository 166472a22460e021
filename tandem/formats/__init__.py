"""Weight formats: every weight the model multiplies by is a `Linear` (DESIGN.md layer 3)."""

from tandem.formats.linear import DenseLinear, FP8BlockLinear, Linear, dequantize_fp8_block, load_linear

__all__ = ["DenseLinear", "FP8BlockLinear", "Linear", "dequantize_fp8_block", "load_linear"]
