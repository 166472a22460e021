// The Gated DeltaNet recurrence over a prefill chunk (tandem/backend/cuda/gdn_prefill.py), after gdn_seq.cu's
// gdn_seq_prep (conv, L2 norms, gates) and before its gdn_seq_norm (the gated RMSNorm).
//
// gdn_prefill_scan<DK, ROWS>
//                 grid (Hv, dv / CB), block 128 = 4 warps. A state column j of v-head h is held by L = DK / ROWS
//                 lanes, ROWS rows each (lane `sub` holds rows (4 (r4 L + sub) + e), e < 4), so a warp holds 32 / L
//                 columns and a block CB = 4 · 32 / L. Per token t, in order (spec/qwen3_5.md §4.7, the recurrent
//                 form with the decay folded into the products):
//                   a = Σ_i k_i S_ij             (each lane's rows in order, then an xor butterfly over the L lanes)
//                   δ = β (v_j − γ a),  γ = exp(g)
//                   S_ij = fma(k_i, δ, γ S_ij);  o_j = Σ_i q_i S_ij  (the updated state; the same order as a)
//                 Tokens are staged GP_TT (16 at DK = 256) at a time in shared memory (k, q of the head's k-head, v of the block's
//                 columns, γ, β). The state stays in registers over the chunk and is written back at its end; block
//                 (0, 0) also sets the conv tail to the last K-1 rows of [tail; mixed] (gdn_seq_prep read it first).
//                 Many more warps than gdn_seq.cu's scan (which keeps decode's bits): its column splits, the
//                 butterfly and the fold of the decay are this kernel's own order. Every token's arithmetic depends
//                 on the state and that token's inputs alone, so a chunk's bits do not depend on where the chunk was
//                 cut (docs/architecture.md, "Exactness"); they are not decode's bits.
// History: v1.
#include "common.cuh"

#define GP_TT 32     // tokens staged a round (half that at DK = 256)
#define GP_WARPS 4   // warps a block

template <int DK, int ROWS>
__device__ __forceinline__ void gdn_prefill_scan_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                      const float* __restrict__ v, const float* __restrict__ g,
                                                      const float* __restrict__ beta, float* __restrict__ state,
                                                      float* __restrict__ y, int T, int Hk, int Hv, int dv,
                                                      float* __restrict__ tail, const float* __restrict__ mixed,
                                                      int tail_rows, int channels) {
  constexpr int L = DK / ROWS;     // lanes a column
  constexpr int CW = 32 / L;       // columns a warp
  constexpr int CB = CW * GP_WARPS;  // columns a block
  constexpr int R4 = ROWS / 4;
  constexpr int TT = DK <= 128 ? GP_TT : GP_TT / 2;  // tokens a round: k and q take 32 KB of static shared memory
  __shared__ __align__(16) float sk[TT][DK];
  __shared__ __align__(16) float sq[TT][DK];
  __shared__ float sv[TT][CB];
  __shared__ float sg[TT], sb[TT];
  const int h = blockIdx.x, kh = h / (Hv / Hk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % L, cw = lane / L;
  const int col0 = blockIdx.y * CB, jl = warp * CW + cw, j = col0 + jl;
  float* st = state + (size_t)h * DK * dv;
  float s[ROWS];
#pragma unroll
  for (int r4 = 0; r4 < R4; ++r4)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * r4 + e] = st[(size_t)((r4 * L + sub) * 4 + e) * dv + j];
  for (int t0 = 0; t0 < T; t0 += TT) {
    const int nt = min(TT, T - t0);
    __syncthreads();  // the previous round's inputs are consumed
    for (int idx = threadIdx.x; idx < nt * (DK / 4); idx += blockDim.x) {
      const int tt = idx / (DK / 4), d4 = idx % (DK / 4);
      const size_t src = ((size_t)(t0 + tt) * Hk + kh) * DK + d4 * 4;
      *reinterpret_cast<float4*>(&sk[tt][d4 * 4]) = *reinterpret_cast<const float4*>(k + src);
      *reinterpret_cast<float4*>(&sq[tt][d4 * 4]) = *reinterpret_cast<const float4*>(q + src);
    }
    for (int idx = threadIdx.x; idx < nt * CB; idx += blockDim.x) {
      const int tt = idx / CB, c = idx % CB;
      sv[tt][c] = v[((size_t)(t0 + tt) * Hv + h) * dv + col0 + c];
    }
    for (int idx = threadIdx.x; idx < nt; idx += blockDim.x) {
      sg[idx] = expf(g[(size_t)(t0 + idx) * Hv + h]);
      sb[idx] = beta[(size_t)(t0 + idx) * Hv + h];
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      const float4* k4 = reinterpret_cast<const float4*>(sk[tt]);
      const float4* q4 = reinterpret_cast<const float4*>(sq[tt]);
      float a = 0.f;
#pragma unroll
      for (int r4 = 0; r4 < R4; ++r4) {
        const float4 kv = k4[r4 * L + sub];
        a = fmaf(kv.x, s[4 * r4], a);
        a = fmaf(kv.y, s[4 * r4 + 1], a);
        a = fmaf(kv.z, s[4 * r4 + 2], a);
        a = fmaf(kv.w, s[4 * r4 + 3], a);
      }
#pragma unroll
      for (int off = 1; off < L; off <<= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
      const float gam = sg[tt];
      const float delta = sb[tt] * (sv[tt][jl] - gam * a);
      float o = 0.f;
#pragma unroll
      for (int r4 = 0; r4 < R4; ++r4) {
        const float4 kv = k4[r4 * L + sub], qv = q4[r4 * L + sub];
        s[4 * r4] = fmaf(kv.x, delta, gam * s[4 * r4]);
        s[4 * r4 + 1] = fmaf(kv.y, delta, gam * s[4 * r4 + 1]);
        s[4 * r4 + 2] = fmaf(kv.z, delta, gam * s[4 * r4 + 2]);
        s[4 * r4 + 3] = fmaf(kv.w, delta, gam * s[4 * r4 + 3]);
        o = fmaf(qv.x, s[4 * r4], o);
        o = fmaf(qv.y, s[4 * r4 + 1], o);
        o = fmaf(qv.z, s[4 * r4 + 2], o);
        o = fmaf(qv.w, s[4 * r4 + 3], o);
      }
#pragma unroll
      for (int off = 1; off < L; off <<= 1) o += __shfl_xor_sync(0xffffffffu, o, off);
      if (sub == 0) y[((size_t)(t0 + tt) * Hv + h) * dv + j] = o;
    }
  }
#pragma unroll
  for (int r4 = 0; r4 < R4; ++r4)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[(size_t)((r4 * L + sub) * 4 + e) * dv + j] = s[4 * r4 + e];
  if (blockIdx.x == 0 && blockIdx.y == 0) {  // the conv tail: the last K-1 rows of [tail; mixed], rows in order
    for (int c = threadIdx.x; c < channels; c += blockDim.x)
      for (int r = 0; r < tail_rows; ++r) {
        const int src = r + T;
        tail[(size_t)r * channels + c] = src < tail_rows ? tail[(size_t)src * channels + c]
                                                         : mixed[(size_t)(src - tail_rows) * channels + c];
      }
  }
}

#define GDN_PREFILL_SCAN_KERNEL(NAME, DK, ROWS)                                                                    \
  extern "C" __global__ void __launch_bounds__(GP_WARPS * 32) gdn_prefill_scan##NAME(                             \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                       \
      const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,                      \
      float* __restrict__ y, int T, int Hk, int Hv, int dv, float* __restrict__ tail,                              \
      const float* __restrict__ mixed, int tail_rows, int channels) {                                              \
    PDL_ENTER                                                                                                      \
    gdn_prefill_scan_impl<DK, ROWS>(q, k, v, g, beta, state, y, T, Hk, Hv, dv, tail, mixed, tail_rows, channels); \
  }
GDN_PREFILL_SCAN_KERNEL(32r8, 32, 8)
GDN_PREFILL_SCAN_KERNEL(64r8, 64, 8)
GDN_PREFILL_SCAN_KERNEL(64r16, 64, 16)
GDN_PREFILL_SCAN_KERNEL(128r8, 128, 8)
GDN_PREFILL_SCAN_KERNEL(128r16, 128, 16)
GDN_PREFILL_SCAN_KERNEL(128r32, 128, 32)
GDN_PREFILL_SCAN_KERNEL(256r16, 256, 16)
GDN_PREFILL_SCAN_KERNEL(256r32, 256, 32)
