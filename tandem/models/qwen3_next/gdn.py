"""Qwen3-Next's fused GDN projections, read into the Qwen3.5 GDN layer (spec/qwen3_5.md §2.5).

``linear_attn.in_proj_qkvz.weight`` [2·Hk·dk + 2·Hv·dv, E] is grouped by key head: its output viewed as
[Hk, 2·dk + 2·r·dv] (r = Hv / Hk) splits into [q dk | k dk | v r·dv | z r·dv] per group; ``in_proj_ba.weight``
[2·Hv, E] viewed as [Hk, 2r] splits into [b r | a r] (transformers ``fix_query_key_value_ordering``). Each of
the four Qwen3.5 projections (in_proj_qkv rows [q heads | k heads | v heads], in_proj_z, in_proj_b, in_proj_a)
is a ``RowSelect`` of the fused Linear, whatever its format; everything after the split is the Qwen3.5 layer.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tandem.checkpoint import Checkpoint, CheckpointError
from tandem.formats import Linear, load_linear
from tandem.models.qwen3_5.hparams import HParams
from tandem.models.qwen3_5.weights import GDNWeights, load_gdn

F32Array = npt.NDArray[np.float32]


class RowSelect:
    """The output rows ``rows`` of another Linear: y = (x · Wᵀ)[:, rows]. Row-invariant when the inner matmul is.

    Attributes: shape (len(rows), in); bytes_per_use: the inner Linear's (the whole fused weight is read).
    """

    def __init__(self, inner: Linear, rows: npt.NDArray[np.int64], name: str) -> None:
        self.inner, self.rows, self.name = inner, rows, name
        self.shape: tuple[int, int] = (int(rows.size), int(inner.shape[1]))
        self.bytes_per_use: int = int(inner.bytes_per_use)

    def matmul(self, x: F32Array) -> F32Array:
        """x [T, in] float32 -> [T, len(rows)] float32 via the inner ``matmul``."""
        return np.ascontiguousarray(self.inner.matmul(x)[:, self.rows])


def fused_rows(hp: HParams) -> dict[str, npt.NDArray[np.int64]]:
    """Row indices of q|k|v ("qkv"), "z" in in_proj_qkvz and of "b", "a" in in_proj_ba, in Qwen3.5 order."""
    hk, dk, dv = hp.linear_num_key_heads, hp.linear_key_head_dim, hp.linear_value_head_dim
    r = hp.linear_num_value_heads // hk
    group, g = 2 * dk + 2 * r * dv, np.arange(hk)[:, None]
    q = (g * group + np.arange(dk)).ravel()
    k = (g * group + dk + np.arange(dk)).ravel()
    v = (g * group + 2 * dk + np.arange(r * dv)).ravel()
    z = (g * group + 2 * dk + r * dv + np.arange(r * dv)).ravel()
    b = (g * 2 * r + np.arange(r)).ravel()
    a = (g * 2 * r + r + np.arange(r)).ravel()
    return {"qkv": np.concatenate([q, k, v]).astype(np.int64), "z": z.astype(np.int64),
            "b": b.astype(np.int64), "a": a.astype(np.int64)}


def load_next_gdn(ckpt: Checkpoint, p: str, hp: HParams) -> GDNWeights:
    """Load ``{p}linear_attn.*`` with fused ``in_proj_qkvz`` / ``in_proj_ba`` (or Qwen3.5's split projections).

    Raises: CheckpointError for a missing or mis-shaped tensor.
    """
    q = p + "linear_attn."
    if not ckpt.has(q + "in_proj_qkvz.weight") and ckpt.has(q + "in_proj_qkv.weight"):
        return load_gdn(ckpt, p, hp)
    e, hv = hp.hidden_size, hp.linear_num_value_heads
    qkvz, ba = load_linear(ckpt, q + "in_proj_qkvz"), load_linear(ckpt, q + "in_proj_ba")
    for lin, shape, name in ((qkvz, (2 * hp.key_dim + 2 * hp.value_dim, e), "in_proj_qkvz"),
                             (ba, (2 * hv, e), "in_proj_ba")):
        if tuple(lin.shape) != shape:
            raise CheckpointError(f"{q}{name}: expected shape {list(shape)}, found {list(lin.shape)}")
    rows = fused_rows(hp)
    out = load_linear(ckpt, q + "out_proj")
    if tuple(out.shape) != (e, hp.value_dim):
        raise CheckpointError(f"{q}out_proj: expected shape {[e, hp.value_dim]}, found {list(out.shape)}")
    return GDNWeights(
        RowSelect(qkvz, rows["qkv"], q + "in_proj_qkvz"), RowSelect(qkvz, rows["z"], q + "in_proj_qkvz"),
        RowSelect(ba, rows["b"], q + "in_proj_ba"), RowSelect(ba, rows["a"], q + "in_proj_ba"), out,
        np.ascontiguousarray(ckpt.get(q + "conv1d.weight", (hp.conv_dim, 1, hp.linear_conv_kernel_dim))[:, 0, :]),
        ckpt.get(q + "A_log", (hv,)), ckpt.get(q + "dt_bias", (hv,)),
        ckpt.get(q + "norm.weight", (hp.linear_value_head_dim,)))
