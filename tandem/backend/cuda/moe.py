"""The sparse MoE MLP on the GPU: routing on the device, the chosen experts' GEMVs reading only their weights.

Kernels: cuda/moe.cu (``moe_route``, ``moe_gather``, ``moe_combine``) and cuda/gemv.cu's routed-expert GEMVs
(``gemv_mma_<fmt>_moe_n<1|4>[_glu]``, listed in gemv.KERNELS). One layer of T rows (``CudaMoE.matmul``):
1. the router and the shared expert's gate (one fused GEMV where the formats allow): logits [T, X (+ 1)];
2. ``moe_route`` (one block): softmax, top-k (ties to the lower index), the renormalised weights, and the n = T · k
   (token, expert) rows sorted by expert then token (``route``, int32 [5n], layout in cuda/moe.cu);
3. ``moe_gather``: the experts' split operand in that order; the gate|up GEMV of every chosen expert in one launch
   (SiLU·mul in its epilogue, writing the down GEMV's operand), then the down GEMV: a block per (row tile, expert
   tile of up to 4 · TPT of its tokens), so a verify reads each expert its rows chose once (up to 16 rows an expert
   for FP8 / NVFP4, 8 for BF16; more re-read it from L2);
4. the shared expert (gate|up glu_pair, down) as the dense MLP, and ``moe_combine``: Σ w · y in ascending expert
   order + σ(gate) · shared.
No host round trip: the expert ids stay on the device, every grid is fixed by T alone, so launch plans record it.
Row invariance: each (token, expert) row is computed by gemv_mma with the bits of the one-row kernel (an MMA column's
result does not depend on the other columns, tests/test_cuda_moe.py), routing and combining read only the token's own
row: a verify row equals a decode row bit for bit.
Weights: every expert's [R, in] of one format stacked into one device Linear [X · R, in] (gemv.concat; gate and up
through gemv.glu_pair), each expert's storage contiguous, found at offsets the kernel computes from the expert id.
Needs the tensor-core path for every expert shape (in % 32 / 64 / 128 for BF16 / FP8 / NVFP4) and R % 16 == 0;
``upload_experts`` raises ValueError otherwise (one line naming the tensor).

References (NumPy): ``reference_route`` (tandem/models/qwen3_5_moe/moe.py ``route`` and the sorted layout),
``reference_experts`` (float64 products of the dequantized weights), ``reference_combine``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda import gemv
from tandem.backend.cuda.gemv_variants import MMA_E
from tandem.backend.cuda.arrays import f32, i32, out_or_new, require
from tandem.backend.cuda.loader import cupy, kernel
from tandem.backend.cuda.operand import NULL, PARTS, SPLIT_CODE, prepare, split_operand
from tandem.backend.cuda.rms_norm import add_rms_norm

KERNELS = ("moe_route", "moe_gather", "moe_combine")
THREADS = 256
MAX_EXPERTS = 1024  # cuda/moe.cu ROUTE_MAX_EXPERTS
MAX_ROWS = 1024  # cuda/moe.cu ROUTE_MAX_ROWS: T · k
MAX_TOKENS = 64
GEMVS = (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear)


def route(logits: Any, experts: int, k: int, renorm: bool, stride: int | None = None, gate: Any = None,
          gate_stride: int = 1) -> tuple[Any, Any]:
    """Top-k routing of router logits on the device (cuda/moe.cu moe_route).

    Args: logits [T, ≥ experts] float32 (row stride ``stride``, default its width); k ≤ experts ≤ MAX_EXPERTS;
    T ≤ MAX_TOKENS; T · k' ≤ MAX_ROWS (k' = k, or k + 1 with ``gate``). gate: the shared expert's gate logits
    (element t · gate_stride for token t), when the shared expert is stacked as expert ``experts``: each token gets
    one more row, that expert with weight σ(gate). Returns: (route int32 [5 T k'], weights float32 [T k']); layout
    in cuda/moe.cu. Raises: ValueError on bad shapes or sizes.
    """
    require("logits", logits, np.float32, (None, None))
    rows, width = (int(n) for n in logits.shape)
    kk = k + (gate is not None)
    if not 1 <= k <= experts <= min(width, MAX_EXPERTS) or not 1 <= rows <= MAX_TOKENS or rows * kk > MAX_ROWS:
        raise ValueError(f"moe route: {rows} rows, k = {k}, {experts} experts (logits width {width}) outside "
                         f"1 ≤ k ≤ experts ≤ {MAX_EXPERTS}, rows ≤ {MAX_TOKENS}, rows · k ≤ {MAX_ROWS}")
    cp, n = cupy(), rows * kk
    table = cp.empty((5 * n,), dtype=cp.int32)
    weights = cp.empty((n,), dtype=cp.float32)
    kernel("moe", "moe_route")((1,), (THREADS,), (logits, i32(width if stride is None else stride), i32(rows),
                                                  i32(experts), i32(k), i32(int(renorm)),
                                                  NULL if gate is None else gate, i32(gate_stride), table, weights))
    return table, weights


def gather(x: Any, table: Any, n: int, kind: str, out: Any = None) -> Any:
    """xs [n, P, in] uint16: row p the split operand (kind) of x row table[3n + p]. x [T, in] float32."""
    require("x", x, np.float32, (None, None))
    in_dim = int(x.shape[1])
    xs = split_operand(kind, out, n, in_dim)
    kernel("moe", "moe_gather")((-(-in_dim // THREADS), n), (THREADS,),
                                (x, table, i32(n), i32(in_dim), xs, i32(SPLIT_CODE[kind])))
    return xs


def expert_gemv(lin: Any, experts: int, xs: Any, table: Any, num_tokens: int, split: str | None = None,
                out: Any = None) -> Any:
    """The chosen experts' GEMV (cuda/gemv.cu gemv_mma_<fmt>_moe_*): row p of the result = xs row p times expert
    table[p]'s weight (a glu_pair Linear: silu(gate) · up, as the next GEMV's operand with ``split``).

    Args: lin: the stacked device Linear [experts · R, in] (``upload_experts``); xs [n, P, in] uint16 (rows in the
    route's sorted order, ``gather`` or a previous expert GEMV); table: the route; num_tokens: T (n = T · k; a
    decode's one token takes the one-column-tile kernel, more the four-tile one: the same bits).
    Returns: [n, R] float32, or glu [n, R/2] float32 / [n, P', R/2] uint16 with ``split``. Raises: ValueError.
    """
    fmt, kind = lin.fmt, lin.prep_kind
    n = int(xs.shape[0])
    rows_all, in_dim = lin.shape
    r = rows_all // experts
    require("xs", xs, np.uint16, (n, PARTS[kind], in_dim))
    width = r // 2 if lin.glu else r
    if lin.glu:
        if split is None:
            y = out_or_new("out", out, (n, width))
            xs_out, result, out_row = NULL, y, width
        else:
            y, xs_out = NULL, split_operand(split, out, n, width)
            result, out_row = xs_out, PARTS[split] * width
    else:
        if split is not None:
            raise ValueError("split output needs the glu epilogue")
        y = out_or_new("out", out, (n, r))
        xs_out, result, out_row = NULL, y, r
    e = MMA_E[fmt]
    w_stride = (r // 16) * (in_dim // (4 * e)) * 64
    s_stride = (r // 8) * -(-in_dim // 128) if fmt == "fp8" else (r // 16) * (in_dim // 128) * 64 if fmt == "nvfp4" \
        else 0
    ntb = 1 if num_tokens == 1 else 4
    name = f"gemv_mma_{fmt}_moe_n{ntb}{'_glu' if lin.glu else ''}"
    kernel("gemv", name)((-(-r // 16), 1, n), (THREADS,),
                         (*lin._v2_args(), xs, y, i32(r), i32(in_dim), i32(0), NULL, NULL, NULL, f32(0.0), xs_out,
                          i32(SPLIT_CODE[split]), NULL, NULL, NULL, i32(0), i32(0), table, i32(n),
                          np.int64(w_stride), np.int64(s_stride), np.int64(out_row)))
    return result


def combine(y: Any, table: Any, weights: Any, num_tokens: int, k: int, shared: Any, gate: Any, gate_stride: int,
            out: Any = None) -> Any:
    """out [T, D] = Σ_r w_r · y[row_r] (ascending expert) + σ(gate[t · gate_stride]) · shared[t] (cuda/moe.cu); shared
    and gate None when the shared expert is one of the rows (stacked, ``route`` with its gate)."""
    n, width = (int(s) for s in y.shape)
    res = out_or_new("out", out, (num_tokens, width))
    kernel("moe", "moe_combine")((-(-width // THREADS), num_tokens), (THREADS,),
                                 (y, table, weights, i32(n), i32(k), i32(width), NULL if shared is None else shared,
                                  NULL if gate is None else gate, i32(gate_stride), res))
    return res


def upload_experts(gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any], name: str) -> tuple[Any, Any]:
    """(gate|up glu_pair Linear [X · 2I, D], down Linear [X · D, I]) of X experts' device Linears (one format).

    Raises: ValueError (naming ``name``) when the experts' Linears are not all one tensor-core GEMV format with
    16-row multiples (e.g. NVFP4 with in % 128 != 0, a fallback fp32 Linear)."""
    parts = list(gates) + list(ups) + list(downs)
    first = parts[0]
    ok = all(type(p) is type(first) and isinstance(p, GEMVS) and p.prep_kind is not None for p in parts) \
        and first.shape[0] % 8 == 0 and downs[0].shape[0] % 16 == 0
    if not ok:
        shapes = sorted({(type(p).__name__, p.shape) for p in parts}, key=str)[:3]
        raise ValueError(f"{name}: the CUDA MoE experts need one BF16 / FP8 block / NVFP4 format with a tensor-core "
                         f"GEMV (in % 32 / 64 / 128 == 0, gate/up rows % 8, down rows % 16); found {shapes}; "
                         "use --device cpu")
    gate_up = gemv.glu_pair(gemv.concat(list(gates)), gemv.concat(list(ups)))
    down = gemv.concat(list(downs))
    return gate_up, down


class CudaMoE:
    """A sparse MoE layer's device weights and its forward (the module docstring), standing where the dense layer's
    gate|up projection stands (``_Layer.gate_up``; ``MoEDelta`` stands for its down projection).

    Args: router: device Linear [X, D], or [X + 1, D] with the shared expert's gate as its last row; shared_gate:
    the [1, D] gate Linear when not fused (else None); gate_up / down: ``upload_experts`` of the X experts, or of
    X + 1 with the shared expert stacked last (``stacked``: then it runs in the routed experts' launches as one more
    row a token, weight σ(gate), and shared_gu / shared_g / shared_u / shared_down are None); else shared_gu: the
    shared expert's glu_pair (or None with shared_g / shared_u separate), shared_down; top_k; renorm.
    ``prep_kind`` None: the layer reads fp32 rows (each GEMV prepares its own operand kind once).
    """

    prep_kind = None
    glu = 0

    def __init__(self, router: Any, shared_gate: Any, experts: int, top_k: int, renorm: bool, gate_up: Any,
                 down: Any, shared_gu: Any, shared_g: Any, shared_u: Any, shared_down: Any,
                 stacked: bool = False) -> None:
        self.router, self.shared_gate, self.experts, self.top_k, self.renorm = \
            router, shared_gate, experts, top_k, renorm
        self.stacked = stacked
        self.stored = experts + int(stacked)  # experts in the stacked Linears
        self.gate_up, self.down = gate_up, down
        self.shared_gu, self.shared_g, self.shared_u, self.shared_down = shared_gu, shared_g, shared_u, shared_down
        width = int(router.shape[1])
        self.shape = (width, width)
        # one expert's weights (codes + scales)
        self.expert_bytes = (int(gate_up.bytes_per_use) + int(down.bytes_per_use)) // self.stored
        shared = [lin for lin in (router, shared_gate, shared_gu, shared_g, shared_u, shared_down) if lin is not None]
        # read by every token (the router, the shared expert's gate and weights)
        self.shared_bytes = sum(int(lin.bytes_per_use) for lin in shared) + (self.expert_bytes if stacked else 0)
        self.bytes_per_use = self.shared_bytes + top_k * self.expert_bytes  # one decode row

    def linears(self) -> list[Any]:
        """Every device Linear of the layer (None where absent)."""
        return [self.router, self.shared_gate, self.gate_up, self.down, self.shared_gu, self.shared_g, self.shared_u,
                self.shared_down]

    def matmul(self, h: Any, out: Any = None, split: str | None = None) -> Any:
        """The MoE MLP of h [T, D] float32 (device) -> [T, D] float32 (spec §7). Raises ValueError (bad h, T)."""
        if split is not None:
            raise ValueError("the MoE layer returns fp32 rows")
        require("h", h, np.float32, (None, self.shape[1]))
        t = int(h.shape[0])
        prepared: dict[str, Any] = {}

        def operand(lin: Any) -> Any:
            kind = lin.prep_kind
            if kind is None:
                return h
            if kind not in prepared:
                prepared[kind] = prepare(h, kind)
            return prepared[kind]

        def mm(lin: Any, a: Any, split: str | None = None) -> Any:
            if a.dtype == np.uint16:
                return lin.matmul_prepared(a, split=split)
            return lin.matmul(a) if split is None else lin.matmul(a, split=split)

        logits = mm(self.router, operand(self.router))
        if self.shared_gate is None:
            gate, gate_stride = logits[:, self.experts:], int(logits.shape[1])
        else:
            gate, gate_stride = mm(self.shared_gate, operand(self.shared_gate)), 1
        table, weights = route(logits, self.experts, self.top_k, self.renorm, stride=int(logits.shape[1]),
                               gate=gate if self.stacked else None, gate_stride=gate_stride)
        rows = self.top_k + int(self.stacked)
        n = t * rows
        xs = gather(h, table, n, self.gate_up.prep_kind)
        act = expert_gemv(self.gate_up, self.stored, xs, table, t, split=self.down.prep_kind)
        y = expert_gemv(self.down, self.stored, act, table, t)
        if self.stacked:
            return combine(y, table, weights, t, rows, None, None, 1, out=out)
        if self.shared_gu is not None:
            kind = self.shared_down.prep_kind
            shared = mm(self.shared_down, mm(self.shared_gu, operand(self.shared_gu), split=kind))
        else:
            from tandem.backend.cuda.silu_mul import silu_mul

            shared = self.shared_down.matmul(silu_mul(self.shared_g.matmul(h), self.shared_u.matmul(h)))
        return combine(y, table, weights, t, self.top_k, shared, gate, gate_stride, out=out)


class MoEDelta:
    """Stands for a MoE layer's down projection (``_Layer.down``): its input is already the layer's fp32 output, so
    ``matmul`` returns it and ``matmul_residual_norm`` is add_rms_norm (the residual add and the next norm, the bits
    of the plain layer loop's add_rms_norm)."""

    prep_kind = None
    glu = 0
    bytes_per_use = 0

    def __init__(self, width: int) -> None:
        self.shape = (width, width)

    def matmul(self, a: Any, out: Any = None) -> Any:
        """a [T, D] float32, returned (copied into ``out`` when given)."""
        if out is None:
            return a
        out[...] = a
        return out

    def resnorm_rows(self) -> int:
        """Any row count (add_rms_norm takes every row)."""
        return MAX_TOKENS

    def matmul_residual_norm(self, a: Any, resid: Any, norm_w: Any, eps: float, split: str | None = None,
                             normed_out: Any = None, out: Any = None) -> Any:
        """resid += a (in place), then the RMSNorm of each row: the split operand (``split``) or fp32 rows; the fp32
        normed rows also into ``normed_out``. Returns what ``gemv.matmul_residual_norm`` returns."""
        if normed_out is None:
            return add_rms_norm(resid, a, norm_w, eps, out=out, split=split)
        add_rms_norm(resid, a, norm_w, eps, out=normed_out)
        if split is not None:
            return prepare(normed_out, split, out=split_operand(split, out, int(a.shape[0]), self.shape[0]))
        return normed_out


# ------------------------------------------------------------------------------------------------ references
def reference_route(logits: np.ndarray, k: int, renorm: bool, gate: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The route table and weights moe_route writes: the host router's arithmetic (tandem/models/qwen3_5_moe/moe.py
    ``route``: float32 softmax, the k most probable by a stable sort of -p, renormalised when ``renorm``), laid out
    sorted by (expert, token); with ``gate`` [T] float32 each token's shared expert too (expert X, weight
    σ(gate[t])). Returns: (route int32 [5n], weights float32 [n]) for n = T · k' (cuda/moe.cu)."""
    lg = np.asarray(logits, np.float32)
    e = np.exp(lg - lg.max(axis=-1, keepdims=True))
    p = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, axis=-1)
    if renorm:
        w = (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)
    if gate is not None:
        sig = (np.float32(1.0) / (np.float32(1.0) + np.exp(-np.asarray(gate, np.float32)))).astype(np.float32)
        top = np.concatenate([top, np.full((top.shape[0], 1), lg.shape[1])], axis=1)
        w = np.concatenate([w, sig[:, None]], axis=1)
        k += 1
    t_rows = top.shape[0]
    n = t_rows * k
    pairs = sorted((int(top[t, j]), t, j) for t in range(t_rows) for j in range(k))
    table = np.zeros(5 * n, np.int32)
    weights = np.zeros(n, np.float32)
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for pos, (e, t, j) in enumerate(pairs):
        first.setdefault(e, pos)
        count[e] = count.get(e, 0) + 1
    for pos, (e, t, j) in enumerate(pairs):
        rank = int(np.sum(top[t] < e))
        table[pos], table[n + pos], table[2 * n + pos], table[3 * n + pos] = e, first[e], first[e] + count[e], t
        table[4 * n + t * k + rank] = pos
        weights[t * k + rank] = w[t, j]
    return table, weights


def reference_experts(weights: Sequence[np.ndarray], x: np.ndarray, table: np.ndarray, glu: bool) -> np.ndarray:
    """float64 rows of the chosen experts' GEMV: row p = x[table[3n + p]] · W_{table[p]}ᵀ; with ``glu`` each weight is
    [2I, in], gate rows then up rows, and the row is silu(gate) · up [I]. weights: float32 [R, in] per expert."""
    n = int(table.size) // 5
    rows = []
    for p in range(n):
        y = np.asarray(x[int(table[3 * n + p])], np.float64) @ np.asarray(weights[int(table[p])], np.float64).T
        if glu:
            half = y.size // 2
            g, u = y[:half], y[half:]
            y = g / (1.0 + np.exp(-g)) * u
        rows.append(y)
    return np.asarray(rows)


def reference_combine(y: np.ndarray, table: np.ndarray, weights: np.ndarray, k: int, shared: np.ndarray,
                      gate: np.ndarray) -> np.ndarray:
    """float32 out[t] = Σ_r w · y[row] in ascending expert order (products rounded, added from 0) + σ(gate[t]) ·
    shared[t], as SparseMoE's accumulation. gate [T] float32."""
    n = int(table.size) // 5
    t_rows = shared.shape[0]
    out = np.zeros(shared.shape, np.float32)
    for t in range(t_rows):
        for r in range(k):
            out[t] += (y[int(table[4 * n + t * k + r])] * weights[t * k + r]).astype(np.float32)
    sig = (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate.astype(np.float32)))).astype(np.float32)
    res: np.ndarray = (out + sig[:, None] * shared).astype(np.float32)
    return res
