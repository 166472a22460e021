"""Loading a checkpoint's linear weight in whichever format its tensor names say (spec/qwen3_5.md §9, §10).

Sits above linear.py (BF16 / FP8 block-scaled) and nvfp4.py (NVFP4, per-tensor / per-row FP8), which build on
each other in that order only.
"""

from __future__ import annotations

import numpy as np

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.formats import nvfp4
from tandem.formats.linear import DenseLinear, FP8BlockLinear, Linear


def load_linear(ckpt: Checkpoint, name_prefix: str) -> Linear:
    """Load `<name_prefix>` in whichever format its tensor names say (spec §9, §10).

    `weight_scale_2` (ModelOpt) or `weight_packed` + `weight_global_scale` (compressed-tensors): NVFP4Linear;
    `weight_scale_inv`: FP8BlockLinear; an F8_E4M3 `weight` with a scalar or per-row `weight_scale`:
    FP8ScaledLinear; otherwise DenseLinear.

    Args:
        ckpt: an open checkpoint; name_prefix e.g. `model.language_model.layers.0.mlp.up_proj`.
    Returns:
        a Linear with shape [out, in].
    Raises:
        CheckpointError: weight absent or not 2-D; FP8 weight not F8_E4M3; bad scale grid or dtype.
    """
    if nvfp4.is_nvfp4(ckpt, name_prefix):
        return nvfp4.load_nvfp4(ckpt, name_prefix)
    weight_name = f"{name_prefix}.weight"
    scale_name = f"{name_prefix}.weight_scale_inv"
    if not ckpt.has(scale_name) and ckpt.has(f"{name_prefix}.weight_scale"):
        return nvfp4.load_fp8_scaled(ckpt, name_prefix)
    w_shape = ckpt.shape(weight_name)
    if len(w_shape) != 2:
        raise CheckpointError(f"{weight_name}: a linear weight must be 2-D, found shape {list(w_shape)}")
    if not ckpt.has(scale_name):
        return DenseLinear(ckpt.get(weight_name), name_prefix)
    if ckpt.dtype(weight_name) != "F8_E4M3":
        raise CheckpointError(
            f"{weight_name}: has {scale_name} but dtype {ckpt.dtype(weight_name)!r}, expected 'F8_E4M3'")
    codes = np.asarray(ckpt.raw(weight_name), dtype=np.uint8)
    scale_raw = ckpt.raw(scale_name)
    return FP8BlockLinear(codes, ckpt.get(scale_name), int(scale_raw.nbytes), name_prefix)
