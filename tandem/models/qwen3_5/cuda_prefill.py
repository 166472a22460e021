"""The CUDA Qwen3.5 model's prefill on tensor cores: a prompt chunk of up to ``CHUNK_ROWS`` tokens through every
layer with bf16 GEMMs (tandem/backend/cuda/prefill_gemm.py), the flash attention prefill
(tandem/backend/cuda/attention_flash.py) and the GDN scan (tandem/backend/cuda/gdn_prefill.py: the recurrent scan, or
with ``gdn_scan = "chunked"`` the chunked WY form on tensor cores, tandem/backend/cuda/gdn_chunk.py).

Per layer: RMSNorm written as the GEMM's bf16 operand (split kind "b16"), the fused input projection (q|k|v, or
qkv|z|a|b), the mixer (flash attention with the K / V rows written to the cache; or the GDN conv, scan and gated
norm, the state and conv tail updated in place) writing the output projection's bf16 operand, the output
projection, the residual add + RMSNorm, the gate|up GEMM, SiLU·mul into the down projection's operand, the down
GEMM; the residual stream stays fp32. Logits come from the head's GEMV (the decode's arithmetic) on the final
normed rows.

Exactness (docs/architecture.md, "Exactness"): every op is row-local with one order of operations for a row
(norms, the elementwise ops and the flash kernel by construction; cuBLAS by ``prefill_gemm.row_invariant``,
checked at the first prefill for every GEMM shape, with every call of at least ``MIN_ROWS`` rows; the GDN scan is
the per-token recurrence), so the state and logits after t[0:n] do not depend on how the prompt was cut into calls
or chunks, nor on a cache restore in between (``Capabilities.prefill_chunk_invariant``). They are not decode's
bits: a decoded state is not a prefilled one (``prefill_matches_decode`` is False on this path). The chunked GDN scan
runs 64-token chunks on the absolute position grid: the contract then holds for cuts at multiples of ``grid`` (64),
which the model declares (``Capabilities.prefill_grid``) so that the prefix cache restores only there.

Weights: each projection's bf16 copy is written per call into one scratch buffer (``weights="layer"``: bounded
memory, one dequantisation of the whole model a call: ~38 ms a call at 27B NVFP4 on an H100, 28 % of a 1,024-token
call) or kept for every later call (``weights="resident"``: two bytes a parameter more on the device, no
dequantisation after the first call). ``weights="auto"`` (the default) keeps them resident when, at the first call,
the device's free memory holds them with ``AUTO_RESERVE`` bytes to spare (the prefix cache's device tier, 8 GB by
default, and the chunk's activations), else dequantises per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.backend.cuda import gdn_chunk, gemv
from tandem.backend.cuda.attention_flash import HEAD_DIMS, attention_flash_prefill
from tandem.backend.cuda.embed import embed
from tandem.backend.cuda.gdn_prefill import DEFAULT_ROWS, SCANS, columns_a_block, gdn_prefill_chunk
from tandem.backend.cuda.gdn_seq import GDNRows, new_rows
from tandem.backend.cuda.loader import cupy, persistent
from tandem.backend.cuda.prefill_gemm import MIN_ROWS, bf16_weight, gemm_b16, row_invariant, weight_shape
from tandem.backend.cuda.rms_norm import add_rms_norm, rms_norm
from tandem.backend.cuda.silu_mul import silu_mul_rows
from tandem.models.device_state import DeviceState
from tandem.models.qwen3_5.cuda_images import chunk_mrope, place_features
from tandem.models.qwen3_5.cuda_layers import _GDN, _Attn, _cols

CHUNK_ROWS = 4096  # the most tokens a chunk runs at once (activations scale with it: ~150 KB a token at 27B)
WEIGHT_MODES = ("auto", "layer", "resident")
AUTO_RESERVE = 12 << 30  # bytes "auto" leaves free beside resident weights
_GEMVS = (gemv.CudaDenseLinear, gemv.CudaFP8BlockLinear, gemv.CudaNVFP4Linear)


class TensorCorePrefill:
    """Runs prefill chunks of one CUDA Qwen3.5 model on tensor cores (module docstring).

    Args: model: the CudaQwen3_5Model (its hp, eps, layers, inv_freq, embed_bits, norm); chunk_rows: the most
    tokens a chunk holds; weights: "auto", "layer" or "resident" (module docstring); gdn_scan: "recurrent" or
    "chunked" (gdn_prefill.SCANS; None: the model's ``GDN_SCAN``, else "recurrent").
    Attributes: ready: whether this model can take the path (every layer's projections fused, BF16 embedding,
    head sizes the flash kernel and the GDN scan take, and cuBLAS row-invariant at every GEMM shape, checked on
    first use); grid: the positions a prefill may be cut at unchanged (64 with the chunked scan, else 1);
    gdn_scan, gdn_rows_per_lane, gdn_precision: the scan and its variants (None / gdn_chunk.DEFAULT_PRECISION by
    default); set gdn_scan before the first chunk (``ready`` and the model's capabilities are settled then).
    Raises: ValueError on an unknown weights mode or scan, chunk_rows < 1, or a chunked scan with chunk_rows not
    a multiple of 64.
    """

    def __init__(self, model: Any, chunk_rows: int = CHUNK_ROWS, weights: str = "layer",
                 gdn_scan: str | None = None) -> None:
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights: expected one of {WEIGHT_MODES}, got {weights!r}")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
        scan = gdn_scan if gdn_scan is not None else str(getattr(model, "GDN_SCAN", "recurrent"))
        if scan not in SCANS:
            raise ValueError(f"gdn_scan: expected one of {SCANS}, got {scan!r}")
        if scan == "chunked" and chunk_rows % gdn_chunk.CHUNK:
            raise ValueError(f"the chunked GDN scan needs chunk_rows a multiple of {gdn_chunk.CHUNK}, got {chunk_rows}")
        self.gdn_scan = scan
        self.gdn_precision = gdn_chunk.DEFAULT_PRECISION  # the chunked scan's mma precision (gdn_chunk.PRECISIONS)
        self._workspace: gdn_chunk.ChunkWorkspace | None = None
        self.model = model
        self.chunk_rows = int(chunk_rows)
        self.weights = weights
        self._ready: bool | None = None
        self._bufs: dict[str, Any] = {}
        self._resident: dict[int, Any] = {}
        self._rows: GDNRows | None = None
        self.gdn_rows_per_lane: int | None = None  # the GDN scan's variant (gdn_prefill.DEFAULT_ROWS when None)

    @property
    def grid(self) -> int:
        """Cut positions that leave a prefill's bits unchanged: multiples of 64 with the chunked GDN scan, else any."""
        return gdn_chunk.CHUNK if self.gdn_scan == "chunked" else 1

    # ------------------------------------------------------------------------------------------ eligibility
    def _linears(self) -> list[Any]:
        out: list[Any] = []
        for lw in self.model.layers:
            m = lw.mixer
            out += [m.proj, m.out if isinstance(m, _GDN) else m.o, lw.gate_up, lw.down]
        return out

    def _shapes_ok(self) -> bool:
        m = self.model
        if not m.FAST or m.embed_bits is None:
            return False
        if any(not isinstance(lin, _GEMVS) for lin in self._linears()):
            return False
        dk, dv = m.hp.linear_key_head_dim, m.hp.linear_value_head_dim
        if m.hp.head_dim not in HEAD_DIMS or dk not in DEFAULT_ROWS:
            return False
        if self.gdn_scan == "chunked" and not gdn_chunk.supports(dk, dv):
            return False
        if self.gdn_scan == "recurrent" and dv % columns_a_block(dk, DEFAULT_ROWS[dk]):
            return False
        return all(not (isinstance(lw.mixer, _Attn) and lw.mixer.proj is None) for lw in m.layers)

    @property
    def ready(self) -> bool:
        """Whether chunks can run here (the class docstring); the first call checks cuBLAS on the device."""
        if self._ready is None:
            ok = self._shapes_ok()
            if ok:
                rows = max(MIN_ROWS, self.chunk_rows)
                shapes = {weight_shape(lin) for lin in self._linears()}
                ok = all(row_invariant(k, n, rows) for n, k in sorted(shapes))
            self._ready = ok
        return self._ready

    # ------------------------------------------------------------------------------------------ buffers
    def _buffers(self) -> dict[str, Any]:
        """The chunk's buffers, allocated once: a16 (bf16 operands, rows × the widest input), y32 (GEMM outputs,
        rows × the widest output)."""
        if not self._bufs:
            cp = cupy()
            rows = max(MIN_ROWS, self.chunk_rows)
            shapes = [weight_shape(lin) for lin in self._linears()]
            widest_in = max(k for _, k in shapes)
            widest_out = max(n for n, _ in shapes)
            with persistent():
                self._bufs["a16"] = cp.empty((rows * widest_in,), dtype=cp.uint16)
                self._bufs["y32"] = cp.empty((rows * widest_out,), dtype=cp.float32)
        return self._bufs

    def _gdn_rows(self, n: int) -> GDNRows:
        if self._rows is None:
            hp = self.model.hp
            with persistent():
                self._rows = new_rows(max(MIN_ROWS, self.chunk_rows), hp.linear_num_key_heads,
                                      hp.linear_num_value_heads, hp.linear_key_head_dim, hp.linear_value_head_dim)
        return GDNRows(*(f[:n] for f in self._rows))

    def _gdn_workspace(self) -> gdn_chunk.ChunkWorkspace | None:
        """The chunked scan's workspace for any chunk (allocated once; None with the recurrent scan)."""
        if self.gdn_scan != "chunked":
            return None
        if self._workspace is None:
            hp = self.model.hp
            with persistent():
                self._workspace = gdn_chunk.new_workspace(self.chunk_rows, hp.linear_num_value_heads,
                                                          hp.linear_key_head_dim, hp.linear_value_head_dim)
        return self._workspace

    def resident_bytes(self) -> int:
        """Device bytes of the resident bf16 weights held now (0 in "layer" mode)."""
        return sum(int(w.nbytes) for w in self._resident.values())

    def weight_bytes(self) -> int:
        """Bytes of every projection's bf16 weight (what "resident" keeps)."""
        return sum(2 * n * k for n, k in (weight_shape(lin) for lin in self._linears()))

    def _choose_weights(self) -> None:
        """Settle "auto" (module docstring) before the first chunk's buffers are taken."""
        if self.weights == "auto":
            free, _ = cupy().cuda.runtime.memGetInfo()
            free += cupy().get_default_memory_pool().free_bytes()  # the pool's cached blocks are free to it
            self.weights = "resident" if free >= self.weight_bytes() + AUTO_RESERVE else "layer"

    def _weight(self, lin: Any) -> Any:
        """lin's bf16 weight [out, in]: the resident copy, or written into the shared scratch ("layer")."""
        if self.weights == "resident":
            w = self._resident.get(id(lin))
            if w is None:
                with persistent():
                    w = self._resident[id(lin)] = bf16_weight(lin)
            return w
        w16 = self._bufs.get("w16")
        if w16 is None:
            with persistent():
                w16 = self._bufs["w16"] = cupy().empty((max(n * k for n, k in map(weight_shape, self._linears())),),
                                                       dtype=np.uint16)
        return bf16_weight(lin, out=w16)

    # ------------------------------------------------------------------------------------------ one chunk
    def _operand(self, t: int, k: int) -> Any:
        """The bf16 operand [t, 1, k] (a view of a16's first t rows; the rows up to MIN_ROWS are the GEMM's
        padding and may hold anything: rows are independent)."""
        return self._buffers()["a16"][:t * k].reshape(t, 1, k)

    def _gemm(self, lin: Any, t: int) -> Any:
        """y [t, out] float32 (a view of y32) = the operand's first t rows · Wᵀ, the call padded to MIN_ROWS rows."""
        n, k = weight_shape(lin)
        rows = max(MIN_ROWS, t)
        bufs = self._buffers()
        a = bufs["a16"][:rows * k].reshape(rows, k)
        y = bufs["y32"][:rows * n].reshape(rows, n)
        gemm_b16(a, self._weight(lin), y)
        return y[:t]

    def forward(self, state: DeviceState, ids: Sequence[int], start: int) -> Any:
        """Post-final-norm hidden rows [T, E] float32 of tokens ``ids`` at positions start..start+T-1 (T ≤
        chunk_rows), the state's recurrent sections, conv tails and KV rows start.. written. The caller checks ids
        and capacity (the model's ``prefill``) and sets ``state.length``. An image prompt's rows
        (``state.multimodal``, cuda_images.py): its features replace the pad rows of the embedding, and the
        attention layers rotate each row at its 3-D position (the prep of vision_mrope.py)."""
        m = self.model
        hp, eps = m.hp, m.eps
        t = len(ids)
        self._choose_weights()
        e = int(hp.hidden_size)
        x = embed(m.embed_bits, ids)  # [T, E] float32, the residual stream
        place_features(x, state, start)
        mrope = chunk_mrope(state, start, t, m.mrope_section)  # None for a text-only sequence
        delta: Any = None
        for i, lw in enumerate(m.layers):
            h = self._operand(t, e)
            if delta is None:
                rms_norm(x, lw.input_norm, eps, out=h, split="b16")
            else:
                add_rms_norm(x, delta, lw.input_norm, eps, out=h, split="b16")
            w = lw.mixer
            y = self._gemm(w.proj, t)
            if isinstance(w, _Attn):
                qg, k, v = _cols(y, w.proj.splits)
                d, nh, nkv = hp.head_dim, hp.num_attention_heads, hp.num_key_value_heads
                attention_flash_prefill(qg.reshape(t, nh, 2 * d), k.reshape(t, nkv, d), v.reshape(t, nkv, d),
                                        w.q_norm, w.k_norm, m.inv_freq, state.buffers[f"layers.{i}.k"],
                                        state.buffers[f"layers.{i}.v"], start, eps, split="b16",
                                        xs=self._operand(t, nh * d), mrope=mrope)
                delta = self._gemm(w.o, t)
            else:
                mixed, z, a, b = _cols(y, w.proj.splits)
                gdn_prefill_chunk(mixed, state.buffers[f"layers.{i}.conv"], w.conv, a, b, w.a_log, w.dt_bias, z,
                                  w.norm, state.buffers[f"layers.{i}.ssm"], hp.linear_num_key_heads, eps,
                                  rows=self._gdn_rows(t), split="b16", xs=self._operand(t, int(z.shape[1])),
                                  rows_per_lane=self.gdn_rows_per_lane, scan=self.gdn_scan, start=start,
                                  precision=self.gdn_precision, workspace=self._gdn_workspace())
                delta = self._gemm(w.out, t)
            add_rms_norm(x, delta, lw.post_norm, eps, out=self._operand(t, e), split="b16")
            gu = self._gemm(lw.gate_up, t)
            silu_mul_rows(gu, out=self._operand(t, int(gu.shape[1]) // 2), split="b16")
            delta = self._gemm(lw.down, t)
        return add_rms_norm(x, delta, m.norm, eps)

