"""One decode token of a Gated DeltaNet layer on the GPU, after its projections. Kernels: cuda/gdn_step.cu, and the
conv step of cuda/gdn_seq.cu (gdn_decode_conv: one copy of that arithmetic for both launchers).

`gdn_decode_step` = conv1d step (tail updated in place) + L2 norms + gates + the gated delta rule for one token
(state updated in place) + gated RMSNorm; its result goes to out_proj. Two launches.

Reference (`reference`): numpy_ops.causal_conv, l2norm, gdn_gates, gdn_step and gated_rms_norm composed as
Qwen3_5Model.gdn_inputs / _gdn do for one token. Relative error ≤ 1e-4 on y and the state (fp32, different
summation order and expf; the conv is rounded step by step as the reference).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.backend import numpy_ops
from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel

KERNELS = ("gdn_step",)  # and gdn_seq.cu's gdn_decode_conv for the conv
CONV_THREADS = 256


def gdn_decode_step(mixed: Any, tail: Any, conv_w: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, z: Any,
                    norm_w: Any, state: Any, num_k_heads: int, eps: float, out: Any = None) -> Any:
    """One token of a GDN layer.

    Args:
        mixed: [C] float32, the in_qkv projection (q | k | v), C = 2·Hk·dk + Hv·dv.
        tail: [K-1, C] float32 conv tail, shifted in place. conv_w: [C, K] float32.
        a, b: [Hv] float32 projections; a_log, dt_bias: [Hv] float32.
        z: [Hv·dv] float32 (the in_z projection); norm_w: [dv] float32.
        state: [Hv, dk, dv] float32, updated in place. num_k_heads: Hk (divides Hv). eps: RMSNorm epsilon.
    Returns: y [Hv·dv] float32 (gated-normed output, out_proj's input).
    Raises: ValueError on a bad dtype / shape, dv not a multiple of 32 or > 1024, or K < 2.
    """
    require("state", state, np.float32, (None, None, None))
    hv, dk, dv = (int(s) for s in state.shape)
    if num_k_heads < 1 or hv % num_k_heads:
        raise ValueError(f"num_k_heads ({num_k_heads}) must divide Hv ({hv})")
    if dv % 32 or dv > 1024:
        raise ValueError(f"dv must be a multiple of 32 and ≤ 1024 (one thread a state column), got {dv}")
    channels = 2 * num_k_heads * dk + hv * dv
    require("mixed", mixed, np.float32, (channels,))
    require("conv_w", conv_w, np.float32, (channels, None))
    taps = int(conv_w.shape[1])
    if taps < 2:
        raise ValueError(f"conv_w: need K ≥ 2 taps, got {taps}")
    require("tail", tail, np.float32, (taps - 1, channels))
    for name, arr in (("a", a), ("b", b), ("a_log", a_log), ("dt_bias", dt_bias)):
        require(name, arr, np.float32, (hv,))
    require("z", z, np.float32, (hv * dv,))
    require("norm_w", norm_w, np.float32, (dv,))
    y = out_or_new("out", out, (hv * dv,))
    u = cupy().empty((channels,), dtype=np.float32)
    kernel("gdn_seq", "gdn_decode_conv")((-(-channels // CONV_THREADS),), (CONV_THREADS,),
                                         (mixed, tail, conv_w, u, i32(channels), i32(taps)))
    q_scale = float(np.float32(1.0 / np.sqrt(dk)))
    kernel("gdn_step", "gdn_step")((hv,), (dv,), (u, a, b, a_log, dt_bias, z, norm_w, state, y, i32(num_k_heads),
                                                  i32(hv), i32(dk), i32(dv), f32(q_scale), f32(eps)),
                                   shared_mem=2 * dk * 4)
    return y


def reference(mixed: np.ndarray, tail: np.ndarray, conv_w: np.ndarray, a: np.ndarray, b: np.ndarray,
              a_log: np.ndarray, dt_bias: np.ndarray, z: np.ndarray, norm_w: np.ndarray, state: np.ndarray,
              num_k_heads: int, eps: float) -> np.ndarray:
    """The NumPy composition of one GDN token (tail and state updated in place); returns y [Hv·dv] float32."""
    hv, dk, dv = state.shape
    kd = num_k_heads * dk
    window = np.concatenate([tail, mixed[None]])
    u = numpy_ops.causal_conv(window, conv_w)
    tail[...] = window[1:]
    q = numpy_ops.l2norm(u[:, :kd].reshape(1, num_k_heads, dk))
    q = (q * np.float32(1.0 / np.sqrt(dk))).astype(np.float32)
    k = numpy_ops.l2norm(u[:, kd:2 * kd].reshape(1, num_k_heads, dk))
    r = hv // num_k_heads
    q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    v = u[:, 2 * kd:].reshape(1, hv, dv)
    g, beta = numpy_ops.gdn_gates(a[None], b[None], a_log, dt_bias)
    o = numpy_ops.gdn_step(state, q[0], k[0], v[0], g[0], beta[0])
    return numpy_ops.gated_rms_norm(o, z.reshape(hv, dv), norm_w, eps).reshape(-1)
