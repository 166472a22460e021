"""NumPy reference ops for the Qwen3.5 hybrid: plain fp32 arithmetic, written for reading.

Every op here is the reference that a CUDA kernel must match (DESIGN.md, "Exactness"). Formulas follow
spec/qwen3_5.md: RMSNorm §3.1, gated RMSNorm §3.2, L2 norm §3.3, causal conv §4.2, gates §4.4, the gated delta
rule in recurrent (§4.7) and chunked (§4.8) form, partial RoPE §5.4, attention §5.5.

Row invariance: the ops of the model's path (``gdn_step`` / ``gdn_rows`` per token, ``attention_rows``, the
row-wise norms and activations) give a row the same bits whatever else is computed with it, so prefill, decode and
verify rows agree, on every CPU: their BLAS calls have shapes fixed by the layer (per token, per head group, per
query row and key block), never by the row count, so the row count never selects a BLAS kernel
(tests/test_row_invariance_cores.py checks it under several forced OpenBLAS core types).
``gdn_chunk`` and ``attention_prefill`` are the chunked / batched forms, kept as references (equal in exact
arithmetic, rounding differently).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

F32 = np.float32
GDN_CHUNK = 64  # prefill pieces end at absolute multiples of this (and the chunked delta rule's chunk size)
KEY_BLOCK = 256  # attention_rows' key blocks (rows of the KV cache), on the absolute grid
HEAD_GROUP = 8  # heads per block-diagonal GEMM of the delta rule's rank-1 update (its work grows with the group)
SMALL_KERNEL = 100 ** 3  # M·N·K at most this: OpenBLAS's small-matrix GEMM kernel (single-threaded)


def silu(x: np.ndarray) -> np.ndarray:
    """x · σ(x), float32."""
    return np.asarray(x / (F32(1.0) + np.exp(-x)), dtype=F32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """σ(x) = 1 / (1 + e^-x), float32."""
    return np.asarray(F32(1.0) / (F32(1.0) + np.exp(-x)), dtype=F32)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), returning x where x > 20 (PyTorch's threshold), float32."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(F32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm: x · rsqrt(mean(x², -1) + eps) · weight, where ``weight`` is already (1 + w).

    Args:
        x: [..., E] float32. weight: [E] float32 (the stored weight plus one). eps: float.
    Returns: [..., E] float32.
    """
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return np.asarray(x * (F32(1.0) / np.sqrt(ms + F32(eps))) * weight, dtype=F32)


def gated_rms_norm(o: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """GDN output norm (norm before gate): (weight · o · rsqrt(mean(o²) + eps)) · silu(z).

    Args: o, z: [..., dv] float32; weight: [dv] float32 (used as is, not 1 + w).
    Returns: [..., dv] float32.
    """
    ms = np.mean(o * o, axis=-1, keepdims=True, dtype=F32)
    n = o * (F32(1.0) / np.sqrt(ms + F32(eps)))
    return np.asarray((weight * n) * silu(z), dtype=F32)


def l2norm(x: np.ndarray) -> np.ndarray:
    """x · rsqrt(sum(x², -1) + 1e-6) (epsilon on the sum, as FLA and transformers)."""
    ss = np.sum(x * x, axis=-1, keepdims=True, dtype=F32)
    return np.asarray(x * (F32(1.0) / np.sqrt(ss + F32(1e-6))), dtype=F32)


def causal_conv(window: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Depthwise causal conv + SiLU over a window that starts with the K-1 tail rows.

    Args:
        window: [K-1+T, C] float32: the conv tail (pre-conv rows of earlier tokens) then this step's T rows.
        weight: [C, K] float32; tap K-1 multiplies the current token.
    Returns: [T, C] float32, u[t] = silu(Σ_j weight[:, j] · window[t + j]).
    """
    k = weight.shape[1]
    t = window.shape[0] - (k - 1)
    acc = window[0:t] * weight[:, 0]
    for j in range(1, k):
        acc = acc + window[j:j + t] * weight[:, j]
    return silu(acc.astype(F32, copy=False))


def gdn_gates(a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decay and write strength of the gated delta rule.

    Args: a, b: [T, Hv] float32 projections; a_log, dt_bias: [Hv] float32.
    Returns: (g, beta): g = −exp(A_log) · softplus(a + dt_bias) (log-decay ≤ 0), beta = σ(b); both [T, Hv].
    """
    g = (-np.exp(a_log) * softplus(a + dt_bias)).astype(F32)
    return g, sigmoid(b)


def _head_group(hv: int, dk: int, dv: int) -> int:
    """Heads a block-diagonal update GEMM covers: the largest divisor G of hv with G ≤ HEAD_GROUP and G²·dk·dv ≤
    SMALL_KERNEL, so the GEMM ([G·dk, G] · [G, dv]) stays in OpenBLAS's single-threaded small-matrix kernel (its
    threaded blocked kernel stalls for milliseconds when the other cores are busy); 0 when no G fits (dk·dv above
    SMALL_KERNEL: the update is then the elementwise product, the same values)."""
    fits = [g for g in range(1, min(hv, HEAD_GROUP) + 1) if hv % g == 0 and g * g * dk * dv <= SMALL_KERNEL]
    return max(fits, default=0)


_threads = threading.local()  # each thread's delta-rule buffers by state shape (made once, reused)


class _DeltaRuleScratch:
    """Buffers of the delta-rule token loop for states [Hv, dk, dv]: ``kdiag`` [Hv/G, G·dk, G], k of each group
    of G heads block-diagonal (zeros elsewhere, written through the view ``diag`` [Hv/G, G, dk]), and the rank-1
    update ``upd`` [Hv/G, G·dk, dv] (G = 1 and ``gemm`` False when no head group fits the small kernel)."""

    def __init__(self, hv: int, dk: int, dv: int) -> None:
        g = _head_group(hv, dk, dv)
        self.gemm = g > 0
        g = max(g, 1)
        blocks = np.zeros((hv // g, g, dk, g), F32)
        self.diag: np.ndarray = np.einsum("nhih->nhi", blocks)  # a writeable view on the diagonal blocks
        self.kdiag = blocks.reshape(hv // g, g * dk, g)
        self.upd = np.empty((hv // g, g * dk, dv), F32)

    @staticmethod
    def of(shape: tuple[int, ...]) -> "_DeltaRuleScratch":
        """This thread's buffers for states of ``shape`` [Hv, dk, dv] (fresh buffers cost a decode step ~25 µs)."""
        cache: dict[tuple[int, ...], _DeltaRuleScratch] | None = getattr(_threads, "scratch", None)
        if cache is None:
            cache = _threads.scratch = {}
        found = cache.get(shape)
        if found is None:
            found = cache[shape] = _DeltaRuleScratch(*shape)
        return found


def _delta_rule_token(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray,
                      beta: np.ndarray, scratch: _DeltaRuleScratch, out: np.ndarray) -> None:
    """One token of the recurrent rule with the decay exp(g) given: the arithmetic ``gdn_step`` and ``gdn_rows``
    share. The rank-1 update k ⊗ δ is one GEMM of the block-diagonal k by δ per group of heads: each element is
    the single product k_i·δ_j plus exact zeros, so for finite δ it is the elementwise product's value (a zero's
    sign aside), at BLAS speed (tests/test_prefill_rows.py compares the two)."""
    hv, dk, dv = state.shape
    state *= decay[:, None, None]  # S ← exp(g) · S
    p = np.matmul(k[:, None, :], state)[:, 0]  # [Hv, dv] = Sᵀ k per head
    delta = beta[:, None] * (v - p)
    groups = scratch.kdiag.shape[0]
    if scratch.gemm:
        scratch.diag[...] = k.reshape(groups, hv // groups, dk)
        np.matmul(scratch.kdiag, delta.reshape(groups, hv // groups, dv), out=scratch.upd)
    else:
        np.multiply(k[:, :, None], delta[:, None, :], out=scratch.upd.reshape(hv, dk, dv))
    state += scratch.upd.reshape(hv, dk, dv)  # S ← S + k ⊗ δ
    np.matmul(q[:, None, :], state, out=out[:, None, :])  # o = Sᵀ q


def gdn_step(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
             beta: np.ndarray) -> np.ndarray:
    """One token of the gated delta rule, recurrent form (spec §4.7), updating ``state`` in place.

    The arithmetic of every token on the NumPy path (decode and verify; prefill runs ``gdn_rows``, the same
    arithmetic token by token): S ← exp(g)·S; δ = β·(v − Sᵀk); S ← S + k ⊗ δ; o = Sᵀq.

    Args:
        state: [Hv, dk, dv] float32, written in place.
        q: [Hv, dk] (L2-normalised and scaled by dk^-1/2), k: [Hv, dk] (L2-normalised), v: [Hv, dv];
        g, beta: [Hv]. All float32, already expanded from k-heads to v-heads.
    Returns: o: [Hv, dv] float32 = S_tᵀ q with the updated state.
    """
    out = np.empty((state.shape[0], state.shape[2]), F32)
    _delta_rule_token(state, q, k, v, np.exp(g), beta, _DeltaRuleScratch.of(state.shape), out)
    return out


def gdn_rows(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
             beta: np.ndarray) -> np.ndarray:
    """T tokens of the recurrent rule one after another, each with ``gdn_step``'s bits (the decay exp(g) of all
    rows at once: an elementwise op, row-invariant), updating ``state`` in place.

    Args: state [Hv, dk, dv]; q, k [T, Hv, dk]; v [T, Hv, dv]; g, beta [T, Hv]; float32, as for ``gdn_step``.
    Returns: o [T, Hv, dv] float32, row t equal to ``gdn_step`` of token t after tokens 0..t-1.
    """
    decay = np.exp(g)
    scratch = _DeltaRuleScratch.of(state.shape)
    out = np.empty(v.shape, F32)
    for t in range(q.shape[0]):
        _delta_rule_token(state, q[t], k[t], v[t], decay[t], beta[t], scratch, out[t])
    return out


def gdn_chunk(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
              beta: np.ndarray) -> np.ndarray:
    """The gated delta rule over one chunk of ≤ 64 tokens, chunked (WY) form (spec §4.8), state in place.

    Equal to ``gdn_step`` applied token by token in exact arithmetic; rounds differently.

    Args:
        state: [Hv, dk, dv] float32 (incoming state, written in place with the outgoing one).
        q, k: [T, Hv, dk]; v: [T, Hv, dv]; g, beta: [T, Hv]; float32, prepared as for ``gdn_step``.
    Returns: o: [T, Hv, dv] float32.
    """
    t = q.shape[0]
    qh, kh, vh = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (q, k, v))  # [Hv, T, d]
    gc = np.cumsum(g.T, axis=-1, dtype=F32)  # [Hv, T] cumulative log-decay G_i
    bt = beta.T[:, :, None]
    tril = np.tril(np.ones((t, t), dtype=bool))
    diff = np.where(tril, gc[:, :, None] - gc[:, None, :], F32(-np.inf))
    decay = np.exp(diff).astype(F32)  # Γ_ij = exp(G_i - G_j), i >= j
    strict = np.tril(np.ones((t, t), dtype=bool), -1)
    lower = np.where(strict, (bt * kh) @ kh.transpose(0, 2, 1) * decay, F32(0.0))  # L_ij, i > j
    # (I + L)^-1 by forward substitution, one row at a time
    inv = np.zeros_like(lower)
    eye = np.eye(t, dtype=F32)
    for i in range(t):
        inv[:, i, :] = eye[i] - np.einsum("hj,hjc->hc", lower[:, i, :i], inv[:, :i, :])
    u = inv @ (bt * vh)  # [Hv, T, dv]
    wk = inv @ (bt * np.exp(gc)[:, :, None] * kh)  # [Hv, T, dk]
    v_new = u - wk @ state
    attn = (qh @ kh.transpose(0, 2, 1)) * decay
    out = (np.exp(gc)[:, :, None] * qh) @ state + attn @ v_new
    g_last = gc[:, -1]
    state *= np.exp(g_last)[:, None, None]
    state += (np.exp(g_last[:, None] - gc)[:, :, None] * kh).transpose(0, 2, 1) @ v_new
    return np.ascontiguousarray(out.transpose(1, 0, 2)).astype(F32, copy=False)


def mrope_tables(positions: np.ndarray, rotary_dim: int, theta: float, section: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, rotary_dim/2] float32 of positions [T, 3] (t, h, w): frequency j takes the axis of the
    interleaved layout of Qwen3.5's 3-D rotary (models/qwen3_5/mrope.py's docstring; transformers' `apply_interleaved_mrope`). With all three positions equal, the bits of ``ops.rope_tables``."""
    half = rotary_dim // 2
    axis = np.zeros(half, np.int64)
    for dim in (1, 2):
        axis[dim:min(half, 3 * int(section[dim])):3] = dim
    inv_freq = (F32(1.0) / (F32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(F32)
                                          / F32(rotary_dim)))).astype(F32)
    ang = positions[:, axis].astype(F32) * inv_freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def rope_tables(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the RoPE angles, [T, rotary_dim/2] float32 (inv_freq_i = θ^(-2i/rd), float32)."""
    inv_freq = (F32(1.0) / (F32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(F32)
                                          / F32(rotary_dim)))).astype(F32)
    ang = positions.astype(F32)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate the first rotary_dim channels of every head in place, half-rotation (NeoX) layout (spec §5.4).

    Args: x: [T, nH, D] float32; cos, sin: [T, rotary_dim/2] float32.
    """
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1 = x[:, :, :half].copy()
    x2 = x[:, :, half:2 * half].copy()
    x[:, :, :half] = x1 * c - x2 * s
    x[:, :, half:2 * half] = x2 * c + x1 * s


ROW_GROUP = 64  # attention_rows takes query rows this many at a time (bounds its [rows, blocks, G, KB] scores)


def attention_rows(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Query rows attending to the cache rows up to their positions, GQA, row-invariant by construction.

    Row t attends to cache rows 0..positions[t]. The keys are cut into blocks of ``KEY_BLOCK`` rows on the
    absolute grid; each (row, block) pair is one GEMM of fixed shape ([G, D] · [D, KEY_BLOCK] for the scores,
    [G, KEY_BLOCK] · [KEY_BLOCK, D] for the values), rows past a row's position are masked (scores −inf, weight
    0), each block's weights are summed over its fixed length, and blocks are accumulated in order
    (``np.cumsum``), each row reading the running sum at its own last block. So a row's bits depend only on its
    query and the cache rows it sees, not on T or the other rows: prefill (T rows) gives decode's (T = 1) bits.

    Args:
        q: [T, H, D] float32. keys, values: [L, Hkv, D] float32 cache buffers (rows past a row's position may
            hold anything finite). positions: [T] int, each < L.
    Returns: [T, H, D] float32; scale D^-1/2, softmax in float32, query head h uses KV head h // (H/Hkv).

    Rows are taken ROW_GROUP at a time, each group over the blocks up to its own last position: a row's bits do not
    depend on the other rows, and a long prefill's temporaries stay ~ROW_GROUP x blocks (not T x blocks, 0.6 GB a
    layer for 1,024 rows at 24k keys) and skip the blocks past every row of the group.
    """
    if q.shape[0] > ROW_GROUP:
        return np.concatenate([_attention_group(q[i:i + ROW_GROUP], keys, values, positions[i:i + ROW_GROUP])
                               for i in range(0, q.shape[0], ROW_GROUP)])
    return _attention_group(q, keys, values, positions)


def _attention_group(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`attention_rows` of at most a few rows (its arithmetic)."""
    t, h, d = q.shape
    hkv = keys.shape[1]
    g = h // hkv
    pos = np.asarray(positions, dtype=np.int64)
    nb = int(pos.max()) // KEY_BLOCK + 1
    n = nb * KEY_BLOCK
    qg = np.ascontiguousarray(q.reshape(t, hkv, g, d).transpose(1, 0, 2, 3))[:, :, None]  # [Hkv, T, 1, G, D]
    pieces = [(keys, values)]
    if n > keys.shape[0]:  # the last block runs past the buffer: that block from a zero-padded copy
        main = (nb - 1) * KEY_BLOCK
        kz, vz = np.zeros((2, KEY_BLOCK) + keys.shape[1:], F32)
        kz[:keys.shape[0] - main], vz[:keys.shape[0] - main] = keys[main:], values[main:]
        pieces = [(keys[:main], values[:main]), (kz, vz)]
    counts = [min(pieces[0][0].shape[0] // KEY_BLOCK, nb)] + [1] * (len(pieces) - 1)  # blocks of each piece
    parts = []
    for (kp, _), m in zip(pieces, counts):
        kt = kp[:m * KEY_BLOCK].reshape(m, KEY_BLOCK, hkv, d).transpose(2, 0, 3, 1)[:, None]  # [Hkv, 1, m, D, KB]
        parts.append(np.matmul(qg, kt))  # [Hkv, T, m, G, KB]
    e = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)  # the scores, then their weights, in place
    e *= F32(1.0 / np.sqrt(d))
    hidden = np.arange(n).reshape(nb, 1, KEY_BLOCK)[None] > pos[:, None, None, None]  # [T, nb, 1, KB]
    np.copyto(e, F32(-np.inf), where=hidden[None])
    e -= e.max(axis=(2, 4), keepdims=True)
    np.exp(e, out=e)
    pv, b0 = [], 0
    for (_, vp), m in zip(pieces, counts):
        vb = vp[:m * KEY_BLOCK].reshape(m, KEY_BLOCK, hkv, d).transpose(2, 0, 1, 3)[:, None]  # [Hkv, 1, m, KB, D]
        pv.append(np.matmul(e[:, :, b0:b0 + m], vb))  # [Hkv, T, m, G, D]
        b0 += m
    rows, last = np.arange(t), pos // KEY_BLOCK
    total = np.cumsum(e.sum(axis=-1, dtype=F32), axis=2)[:, rows, last]  # [Hkv, T, G]
    acc = np.cumsum(pv[0] if len(pv) == 1 else np.concatenate(pv, axis=2), axis=2)[:, rows, last]  # [Hkv, T, G, D]
    out = acc / total[..., None]
    return np.ascontiguousarray(out.transpose(1, 0, 2, 3)).reshape(t, h, d).astype(F32, copy=False)


def attention_decode(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One query position attending to ``keys``/``values`` (all visible rows, in position order), GQA.

    Args:
        q: [H, D] float32; keys, values: [S, Hkv, D] float32, S visible rows.
    Returns: [H, D] float32: ``attention_rows`` of the one row at position S-1 (the bits of a prefill row there).
    """
    out: np.ndarray = attention_rows(q[None], keys, values, np.asarray([keys.shape[0] - 1]))[0]
    return out


def attention_prefill(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """Causal attention of T queries at positions start..start+T-1 over keys 0..start+T-1, GQA.

    Args: q: [T, H, D]; keys, values: [start+T, Hkv, D]; float32.
    Returns: [T, H, D] float32.
    """
    t, h, d = q.shape
    hkv = keys.shape[1]
    grp = h // hkv
    s = keys.shape[0]
    qg = q.reshape(t, hkv, grp, d).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    scores = qg @ keys.transpose(1, 2, 0)[:, None] * F32(1.0 / np.sqrt(d))  # [Hkv, G, T, S]
    visible = np.arange(s)[None, :] <= (start + np.arange(t))[:, None]
    scores = np.where(visible, scores, F32(-np.inf))
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = (scores / scores.sum(axis=-1, keepdims=True)).astype(F32)
    out = probs @ values.transpose(1, 0, 2)[:, None]  # [Hkv, G, T, D]
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3)).reshape(t, h, d).astype(F32, copy=False)
