"""The CUDA backend's shape limits for a Qwen3.5 dense config: which dimension, if any, its kernels cannot serve.

The config loader (hparams.py) accepts any positive sizes with consistent head ratios; the GPU kernels serve fewer.
`cuda_limit` names the first config field outside them, so `--device auto` can fall back to the CPU and
`--device cuda` can fail at load, both before a weight reaches the device, instead of a launcher refusing a shape
at the first generate. Every limit below is one a launcher raises ValueError for; the shapes a launcher serves by a
slower path are not limits (a GEMV whose input size misses the tensor-core tile
takes the CUDA-core kernel or the fp32 `CudaF32Linear`, backend/cuda/upload.py; argmax, sampling and the
embedding take any vocabulary).

Limits, by kernel (launcher: its check):
- Gated DeltaNet (backend/cuda/gdn_seq.py `_check_layer`; gdn_seq.cu ScanShape): key head size
  ``linear_key_head_dim`` ∈ KEY_HEAD_SIZES (32, 64, 128, 256: a scan and a decode head kernel each); value head
  size ``linear_value_head_dim`` a multiple of 32 and ≤ 1024 (one thread a state column); conv taps
  ``linear_conv_kernel_dim`` in 2..8 (the prep kernel's window registers).
- Attention, decode / tree verify / prefill (backend/cuda/attention_decode.py `_check_heads`, attention_tree.py;
  the MTP head's attention too): ``head_dim`` a multiple of 32 and ≤ 256, ``num_attention_heads /
  num_key_value_heads`` ≤ 8 (MAX_GROUP: query heads a KV head).
- Residual + RMSNorm GEMV epilogue (backend/cuda/gemv.py ``matmul_residual_norm``, decode's out projections):
  ``hidden_size`` ≤ 16 · RESNORM_SLOTS (131,072 outputs a row).
"""

from __future__ import annotations

from tandem.backend.cuda import attention_decode, attention_tree, gdn_seq, gemv
from tandem.models.qwen3_5.hparams import HParams

MAX_VALUE_HEAD_DIM = 1024  # gdn_seq.cu DECODE_MAX_DV: one thread a state column, ≤ 1024 a block
ATTENTION_HEAD_DIM_STEP = 32  # attention_*.py: head dim a multiple of 32 ...
MAX_ATTENTION_HEAD_DIM = 256  # ... and at most 256
MAX_GROUP = min(attention_decode.MAX_GROUP, attention_tree.MAX_GROUP)  # query heads a KV head
MAX_HIDDEN = 16 * gemv.RESNORM_SLOTS


def cuda_limit(hp: HParams) -> str | None:
    """The first dimension of ``hp`` the CUDA kernels cannot serve, or None when they serve every one.

    Args: hp: validated Qwen3.5 hyper-parameters (HParams.from_config; the MoE adapter's HParams too).
    Returns: None, or one line naming the config field, its value and the kernel's limit, e.g.
        "config field 'linear_key_head_dim' = 48: the CUDA GDN kernels take 32, 64, 128 or 256".
    """
    sizes = gdn_seq.KEY_HEAD_SIZES
    group = hp.num_attention_heads // hp.num_key_value_heads
    checks: list[tuple[bool, str, int, str]] = [
        (hp.linear_key_head_dim in sizes, "linear_key_head_dim", hp.linear_key_head_dim,
         f"the CUDA GDN kernels take {', '.join(map(str, sizes[:-1]))} or {sizes[-1]}"),
        (hp.linear_value_head_dim % 32 == 0 and hp.linear_value_head_dim <= MAX_VALUE_HEAD_DIM,
         "linear_value_head_dim", hp.linear_value_head_dim,
         f"the CUDA GDN kernels take a multiple of 32 up to {MAX_VALUE_HEAD_DIM} (a thread a state column)"),
        (2 <= hp.linear_conv_kernel_dim <= gdn_seq.MAX_TAPS, "linear_conv_kernel_dim", hp.linear_conv_kernel_dim,
         f"the CUDA GDN kernels take 2 to {gdn_seq.MAX_TAPS} conv taps"),
        (hp.head_dim % ATTENTION_HEAD_DIM_STEP == 0 and hp.head_dim <= MAX_ATTENTION_HEAD_DIM, "head_dim",
         hp.head_dim, f"the CUDA attention kernels take a multiple of {ATTENTION_HEAD_DIM_STEP} up to "
                      f"{MAX_ATTENTION_HEAD_DIM}"),
        (group <= MAX_GROUP, "num_attention_heads", hp.num_attention_heads,
         f"{group} query heads a KV head (num_key_value_heads = {hp.num_key_value_heads}); the CUDA attention "
         f"kernels take at most {MAX_GROUP}"),
        (hp.hidden_size <= MAX_HIDDEN, "hidden_size", hp.hidden_size,
         f"the CUDA residual + norm GEMV takes at most {MAX_HIDDEN}"),
    ]
    for ok, field, value, limit in checks:
        if not ok:
            return f"config field {field!r} = {value}: {limit}"
    return None
