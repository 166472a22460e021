"""Weight formats: every weight the model multiplies by is a `Linear` (DESIGN.md layer 3)."""

from tandem.formats.linear import DenseLinear, FP8BlockLinear, Linear, dequantize_fp8_block
from tandem.formats.load import load_linear
from tandem.formats.nvfp4 import FP8ScaledLinear, NVFP4Linear, dequantize_nvfp4, quantize_nvfp4

__all__ = ["DenseLinear", "FP8BlockLinear", "FP8ScaledLinear", "Linear", "NVFP4Linear", "dequantize_fp8_block",
           "dequantize_nvfp4", "load_linear", "quantize_nvfp4"]
