"""The CUDA backend: kernels in `cuda/*.cu`, compiled by NVRTC through CuPy (loader.py), one launcher module per
kernel source with the NumPy reference it must match (DESIGN.md layer 4; STYLE.md: `.cu` + launcher + reference +
test share a stem). CuPy is imported lazily, inside the launchers, so importing this package needs no GPU.

Launcher modules (device arrays in, device arrays out): gemv (CudaDenseLinear / CudaFP8BlockLinear /
CudaNVFP4Linear), rms_norm (rms_norm, add_rms_norm), silu_mul, gdn_step (gdn_decode_step), attention_decode
(attention_decode, attention_decode_step), argmax. Functions named like their module are not re-exported here,
so `from tandem.backend.cuda import rms_norm` is always the module.
"""

from tandem.backend.cuda.attention_decode import attention_decode_step
from tandem.backend.cuda.gdn_step import gdn_decode_step
from tandem.backend.cuda.gemv import CudaDenseLinear, CudaFP8BlockLinear, CudaNVFP4Linear
from tandem.backend.cuda.loader import gpu_available
from tandem.backend.cuda.rms_norm import add_rms_norm

__all__ = ["attention_decode_step", "gdn_decode_step", "CudaDenseLinear", "CudaFP8BlockLinear", "CudaNVFP4Linear",
           "gpu_available", "add_rms_norm"]
