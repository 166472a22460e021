// The Gated DeltaNet recurrence over a prefill call in the chunked (WY) form on tensor cores
// (tandem/backend/cuda/gdn_chunk.py), after gdn_seq.cu's gdn_seq_prep (conv, L2 norms, gates) and before its
// gdn_seq_norm (the gated RMSNorm). Yang et al., "Gated Delta Networks" (arXiv 2412.06464) §3; the WY form of
// "Parallelizing Linear Transformers with the Delta Rule over Sequence Length" (arXiv 2406.06484) §3.
//
// Chunks of 64 tokens on the absolute position grid: chunk c covers tile rows r = 0..63, token t = 64c - lead + r
// (lead = the call's first position mod 64); rows outside [0, T) are zeros with g = beta = 0, which makes them
// inert (no state change, no output). Per chunk and v-head, with S the state at the chunk's start [DK, dv]:
//   G_r = Σ_{i≤r} g_i (in order),  Γ_r = exp(G_r),  dec_r = exp(G_63 - G_r)
//   A_ri = β_r · (exp(G_r - G_i) · k_r·k_i)  (i < r),  T = (I + A)^-1  (forward substitution, fp32)
//   W = T · diag(β Γ) K,  U = T · diag(β) V,  P_ri = exp(G_r - G_i) · q_r·k_i  (i ≤ r)
//   Δ = U - W S,  O = diag(Γ) Q S + P Δ,  S' = Γ_63 S + (diag(dec) K)ᵀ Δ
// which equals the recurrent rule token by token (S = γ S; δ = β (v - Sᵀk); S += k δᵀ; o = Sᵀq) in exact arithmetic.
//
// gdn_chunk_prep<DK, SPLIT>  grid (chunks, Hv), block 128 = 4 warps, one block a chunk and v-head (in parallel over
//   the whole call): K Kᵀ and Q Kᵀ (warp w: tile rows 16w.., the lower triangle's column tiles), A into shared
//   memory, P to the workspace; T by forward substitution (two lanes of one warp a column j, each summing every
//   other group of 4 terms, then one shuffle); W and U (column tiles of 64) to the workspace; Γ and dec too.
// gdn_chunk_scan<DK, SPLIT>  grid (Hv, dv / 64), block 256 = 8 warps, one block 64 state columns of a v-head; the
//   state [DK, 64] stays in mma accumulators over the call (warp w: DK / 16 tiles of 16 × 8) and in shared memory
//   as the next products' operand. Per chunk, in order: Δ (warp w: rows 16 (w / 2).., 4 column tiles) into shared
//   memory; O (the same tiles) to y; S' in the accumulators. Inputs through cp.async, W and U of the next chunk
//   landing during O and S', its Q, K, P during the next Δ. Block (0, 0) also sets the conv tail to the last K-1
//   rows of [tail; mixed] (gdn_seq_prep read it first).
// Products: mma.sync m16n8k8 TF32 with fp32 accumulators; SPLIT = 3 splits every operand x into tf32 hi +
//   tf32(x - hi) and adds lo·hi, hi·lo, hi·hi (3xTF32: fp32-class error, ~1e-6 relative); SPLIT = 1 rounds each
//   operand to TF32 once (~5e-4 relative on y and the state at 32k tokens: the NumPy twin's measurement).
// Every chunk's arithmetic depends on its tokens and the state alone (fixed tiles, fixed orders, no atomics), so a
// call from a grid position gives the same bits however the tokens were split at multiples of 64
// (docs/architecture.md, "Exactness"); a split elsewhere changes the partial chunk's rounding.
// Workspace (float32): W [chunks, Hv, 64, DK], U [chunks, Hv, 64, dv], P [chunks, Hv, 64, 64] (zeros above the
//   diagonal), GD [chunks, Hv, 2, 64] (Γ, dec). Shared memory: prep 64 · (2 (max(DK, 64) + 4) + 2 · 68 + 4) floats,
//   scan 64 · (3 (DK + 4) + 3 · 68) + DK · 68 + 128 floats (189 KB at DK = 128), dynamic.
// History: v1.
#include "common.cuh"

#define GC_CHUNK 64
#define GC_LA 68  // row stride (floats) of the 64-wide tiles: ≡ 4 mod 32, so fragment loads hit 32 banks

__device__ __forceinline__ u32 tf32_bits(float x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Operand fragments of m16n8k8 (lane = 4 gid + tig): A a0 (gid, tig), a1 (gid + 8, tig), a2 (gid, tig + 4),
// a3 (gid + 8, tig + 4); B b0 (k tig, n gid), b1 (k tig + 4, n gid); C c0 (gid, 2 tig), c1 (gid, 2 tig + 1),
// c2 (gid + 8, 2 tig), c3 (gid + 8, 2 tig + 1). hi / lo: the operand's TF32 split (lo unused at SPLIT = 1).
template <int SPLIT>
struct FragA {
  u32 h[4], l[4];
  __device__ __forceinline__ void set(int i, float x) {
    h[i] = tf32_bits(x);
    if (SPLIT == 3) l[i] = tf32_bits(x - __uint_as_float(h[i]));
  }
};

template <int SPLIT>
struct FragB {
  u32 h[2], l[2];
  __device__ __forceinline__ void set(int i, float x) {
    h[i] = tf32_bits(x);
    if (SPLIT == 3) l[i] = tf32_bits(x - __uint_as_float(h[i]));
  }
};

template <int SPLIT>
__device__ __forceinline__ void mma_acc(float (&d)[4], const FragA<SPLIT>& a, const FragB<SPLIT>& b) {
  if (SPLIT == 3) {
    mma_tf32(d, a.l, b.h[0], b.h[1]);
    mma_tf32(d, a.h, b.l[0], b.l[1]);
  }
  mma_tf32(d, a.h, b.h[0], b.h[1]);
}

// A(m, k) = X[m][k] of the tile at (m0, k0); X row-major with row stride ld.
template <int SPLIT>
__device__ __forceinline__ FragA<SPLIT> load_a(const float* X, int ld, int m0, int k0, int gid, int tig) {
  FragA<SPLIT> a;
  a.set(0, X[(m0 + gid) * ld + k0 + tig]);
  a.set(1, X[(m0 + gid + 8) * ld + k0 + tig]);
  a.set(2, X[(m0 + gid) * ld + k0 + tig + 4]);
  a.set(3, X[(m0 + gid + 8) * ld + k0 + tig + 4]);
  return a;
}

// A(m, k) = X[k][m] · s[k] (a transposed operand with a scale a k).
template <int SPLIT>
__device__ __forceinline__ FragA<SPLIT> load_a_t(const float* X, int ld, const float* s, int m0, int k0, int gid,
                                                 int tig) {
  FragA<SPLIT> a;
  const float s0 = s[k0 + tig], s1 = s[k0 + tig + 4];
  a.set(0, X[(k0 + tig) * ld + m0 + gid] * s0);
  a.set(1, X[(k0 + tig) * ld + m0 + gid + 8] * s0);
  a.set(2, X[(k0 + tig + 4) * ld + m0 + gid] * s1);
  a.set(3, X[(k0 + tig + 4) * ld + m0 + gid + 8] * s1);
  return a;
}

// B(k, n) = X[k][n] (s null) or X[k][n] · s[k].
template <int SPLIT>
__device__ __forceinline__ FragB<SPLIT> load_b(const float* X, int ld, const float* s, int k0, int n0, int gid,
                                               int tig) {
  FragB<SPLIT> b;
  const float x0 = X[(k0 + tig) * ld + n0 + gid], x1 = X[(k0 + tig + 4) * ld + n0 + gid];
  b.set(0, s ? x0 * s[k0 + tig] : x0);
  b.set(1, s ? x1 * s[k0 + tig + 4] : x1);
  return b;
}

// B(k, n) = X[n][k] (a row-major matrix used transposed: K Kᵀ, Q Kᵀ).
template <int SPLIT>
__device__ __forceinline__ FragB<SPLIT> load_b_t(const float* X, int ld, int k0, int n0, int gid, int tig) {
  FragB<SPLIT> b;
  b.set(0, X[(n0 + gid) * ld + k0 + tig]);
  b.set(1, X[(n0 + gid) * ld + k0 + tig + 4]);
  return b;
}

// Row r and column n of accumulator element e of the tile at (m0, n0).
__device__ __forceinline__ int acc_row(int m0, int gid, int e) { return m0 + gid + (e >> 1) * 8; }
__device__ __forceinline__ int acc_col(int n0, int tig, int e) { return n0 + 2 * tig + (e & 1); }

// ------------------------------------------------------------------------------------------ phase 1: per chunk
template <int DK, int SPLIT>
__device__ __forceinline__ void gdn_chunk_prep_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                    const float* __restrict__ v, const float* __restrict__ g,
                                                    const float* __restrict__ beta, float* __restrict__ ws_w,
                                                    float* __restrict__ ws_u, float* __restrict__ ws_p,
                                                    float* __restrict__ ws_gd, int T, int lead, int Hk, int Hv,
                                                    int dv) {
  constexpr int LK = DK + 4;
  constexpr int LX = (DK > GC_CHUNK ? DK : GC_CHUNK) + 4;
  constexpr int NT = (DK < 64 ? DK : 64) / 8;  // column tiles a pass of W
  extern __shared__ __align__(16) float smem[];
  float* sK = smem;                        // [64][LK] k rows of the chunk
  float* sX = sK + GC_CHUNK * LK;          // [64][LX] q rows, then v column tiles of 64
  float* sA = sX + GC_CHUNK * LX;          // [64][GC_LA] A (strictly lower)
  float* sT = sA + GC_CHUNK * GC_LA;       // [64][GC_LA] T = (I + A)^-1 (lower, unit diagonal)
  float* sG = sT + GC_CHUNK * GC_LA;       // [64] G
  float* sB = sG + GC_CHUNK;               // [64] beta
  float* sBg = sB + GC_CHUNK;              // [64] beta · Γ
  const int c = blockIdx.x, h = blockIdx.y, kh = h / (Hv / Hk);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int t0 = c * GC_CHUNK - lead;
  const size_t blk = (size_t)c * Hv + h;
  float* W = ws_w + blk * GC_CHUNK * DK;
  float* U = ws_u + blk * GC_CHUNK * dv;
  float* P = ws_p + blk * GC_CHUNK * GC_CHUNK;
  float* GD = ws_gd + blk * 2 * GC_CHUNK;
  for (int idx = tid; idx < GC_CHUNK * (DK / 4); idx += blockDim.x) {
    const int r = idx / (DK / 4), d4 = idx % (DK / 4), t = t0 + r;
    float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), qv = kv;
    if (t >= 0 && t < T) {
      const size_t src = ((size_t)t * Hk + kh) * DK + 4 * d4;
      kv = *reinterpret_cast<const float4*>(k + src);
      qv = *reinterpret_cast<const float4*>(q + src);
    }
    *reinterpret_cast<float4*>(sK + r * LK + 4 * d4) = kv;
    *reinterpret_cast<float4*>(sX + r * LX + 4 * d4) = qv;
  }
  if (tid < GC_CHUNK) {
    const int t = t0 + tid;
    const bool ok = t >= 0 && t < T;
    sG[tid] = ok ? g[(size_t)t * Hv + h] : 0.f;
    sB[tid] = ok ? beta[(size_t)t * Hv + h] : 0.f;
  }
  __syncthreads();
  if (tid == 0) {  // G: the prefix sums in order
    float acc = 0.f;
    for (int r = 0; r < GC_CHUNK; ++r) sG[r] = acc = acc + sG[r];
  }
  __syncthreads();
  if (tid < GC_CHUNK) {
    const float gam = expf(sG[tid]);
    sBg[tid] = sB[tid] * gam;
    GD[tid] = gam;
    GD[GC_CHUNK + tid] = expf(sG[GC_CHUNK - 1] - sG[tid]);
  }
  {  // K Kᵀ -> A (shared), Q Kᵀ -> P (workspace); warp w: rows 16w.., column tiles 0 .. 2w + 1 (the lower part)
    const int m0 = 16 * warp, ntiles = 2 * warp + 2;
    float s[8][4] = {}, p[8][4] = {};
    for (int k0 = 0; k0 < DK; k0 += 8) {
      const FragA<SPLIT> ak = load_a<SPLIT>(sK, LK, m0, k0, gid, tig);
      const FragA<SPLIT> aq = load_a<SPLIT>(sX, LX, m0, k0, gid, tig);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if (nt < ntiles) {
          const FragB<SPLIT> b = load_b_t<SPLIT>(sK, LK, k0, 8 * nt, gid, tig);
          mma_acc<SPLIT>(s[nt], ak, b);
          mma_acc<SPLIT>(p[nt], aq, b);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = acc_row(m0, gid, e), i = acc_col(8 * nt, tig, e);
        const float m = i <= r ? expf(sG[r] - sG[i]) : 0.f;
        sA[r * GC_LA + i] = i < r ? sB[r] * (m * s[nt][e]) : 0.f;
        P[r * GC_CHUNK + i] = i <= r ? m * p[nt][e] : 0.f;
      }
    }
  }
  __syncthreads();
  {  // T = (I + A)^-1, column j by lanes 2 (j % 16) + half of warp j / 16: T[r][j] = -Σ_{i<r} A[r][i] T[i][j]
    const int j = 16 * warp + (lane >> 1), half = lane & 1;
    for (int i = 0; i < GC_CHUNK; ++i)
      if (half == 0) sT[i * GC_LA + j] = i == j ? 1.f : 0.f;
    __syncwarp();
    for (int r = 1; r < GC_CHUNK; ++r) {
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      for (int i = 4 * half; i < r; i += 8) {  // groups of 4 terms: even groups half 0, odd groups half 1
        const float4 av = *reinterpret_cast<const float4*>(sA + r * GC_LA + i);  // A[r][i ≥ r] = 0
        a0 = fmaf(av.x, sT[i * GC_LA + j], a0);
        a1 = fmaf(av.y, sT[(i + 1) * GC_LA + j], a1);
        a2 = fmaf(av.z, sT[(i + 2) * GC_LA + j], a2);
        a3 = fmaf(av.w, sT[(i + 3) * GC_LA + j], a3);
      }
      float sum = (a0 + a1) + (a2 + a3);
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // both lanes: (even + odd) in one order
      if (half == 0 && r > j) sT[r * GC_LA + j] = -sum;
      __syncwarp();
    }
  }
  __syncthreads();
  const int m0 = 16 * warp, ksteps = 2 * warp + 2;  // T is lower triangular: columns < 16 (w + 1)
  for (int n0 = 0; n0 < DK; n0 += 8 * NT) {  // W = T · diag(β Γ) K
    float acc[NT][4] = {};
    for (int ks = 0; ks < ksteps; ++ks) {
      const FragA<SPLIT> a = load_a<SPLIT>(sT, GC_LA, m0, 8 * ks, gid, tig);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        mma_acc<SPLIT>(acc[nt], a, load_b<SPLIT>(sK, LK, sBg, 8 * ks, n0 + 8 * nt, gid, tig));
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = acc_col(n0 + 8 * nt, tig, 0);
      *reinterpret_cast<float2*>(W + acc_row(m0, gid, 0) * DK + col) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(W + acc_row(m0, gid, 2) * DK + col) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
  for (int c0 = 0; c0 < dv; c0 += GC_CHUNK) {  // U = T · diag(β) V, 64 columns at a time through sX
    __syncthreads();  // sX's previous contents consumed
    for (int idx = tid; idx < GC_CHUNK * (GC_CHUNK / 4); idx += blockDim.x) {
      const int r = idx / (GC_CHUNK / 4), c4 = idx % (GC_CHUNK / 4), t = t0 + r;
      float4 vv = make_float4(0.f, 0.f, 0.f, 0.f);
      if (t >= 0 && t < T) vv = *reinterpret_cast<const float4*>(v + ((size_t)t * Hv + h) * dv + c0 + 4 * c4);
      *reinterpret_cast<float4*>(sX + r * LX + 4 * c4) = vv;
    }
    __syncthreads();
    float acc[8][4] = {};
    for (int ks = 0; ks < ksteps; ++ks) {
      const FragA<SPLIT> a = load_a<SPLIT>(sT, GC_LA, m0, 8 * ks, gid, tig);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) mma_acc<SPLIT>(acc[nt], a, load_b<SPLIT>(sX, LX, sB, 8 * ks, 8 * nt, gid, tig));
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = c0 + acc_col(8 * nt, tig, 0);
      *reinterpret_cast<float2*>(U + acc_row(m0, gid, 0) * dv + col) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(U + acc_row(m0, gid, 2) * dv + col) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
}

// ------------------------------------------------------------------------------------------ phase 2: the scan
template <int DK>
struct ScanSmem {  // offsets (floats) into the scan's dynamic shared memory
  static constexpr int LK = DK + 4;
  static constexpr int W = 0, Q = W + GC_CHUNK * LK, K = Q + GC_CHUNK * LK, P = K + GC_CHUNK * LK;
  static constexpr int U = P + GC_CHUNK * GC_LA, D = U + GC_CHUNK * GC_LA, S = D + GC_CHUNK * GC_LA;
  static constexpr int GD = S + DK * GC_LA, TOTAL = GD + 2 * GC_CHUNK;
};

template <int DK, int SPLIT>
__device__ __forceinline__ void gdn_chunk_scan_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                    const float* __restrict__ ws_w, const float* __restrict__ ws_u,
                                                    const float* __restrict__ ws_p, const float* __restrict__ ws_gd,
                                                    float* __restrict__ state, float* __restrict__ y, int T,
                                                    int lead, int Hk, int Hv, int dv, float* __restrict__ tail,
                                                    const float* __restrict__ mixed, int tail_rows, int channels) {
  using L = ScanSmem<DK>;
  constexpr int LK = L::LK;
  constexpr int NS = DK / 16;  // state tiles a warp (DK / 16 row tiles × 8 column tiles over 8 warps)
  extern __shared__ __align__(16) float smem[];
  float *sW = smem + L::W, *sQ = smem + L::Q, *sK = smem + L::K, *sP = smem + L::P;
  float *sU = smem + L::U, *sD = smem + L::D, *sS = smem + L::S, *sGD = smem + L::GD;
  const int h = blockIdx.x, col0 = blockIdx.y * GC_CHUNK, kh = h / (Hv / Hk);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int num_chunks = (lead + T + GC_CHUNK - 1) / GC_CHUNK;
  float* st = state + (size_t)h * DK * dv + col0;

  auto issue_wu = [&](int c) {  // W [64][DK] and U's 64 columns of chunk c
    const size_t blk = (size_t)c * Hv + h;
    const float* w = ws_w + blk * GC_CHUNK * DK;
    const float* u = ws_u + blk * GC_CHUNK * dv + col0;
    for (int idx = tid; idx < GC_CHUNK * (DK / 4); idx += blockDim.x) {
      const int r = idx / (DK / 4), d4 = idx % (DK / 4);
      cp_async16(smem_u32(sW + r * LK + 4 * d4), w + r * DK + 4 * d4, true);
    }
    for (int idx = tid; idx < GC_CHUNK * 16; idx += blockDim.x) {
      const int r = idx / 16, c4 = idx % 16;
      cp_async16(smem_u32(sU + r * GC_LA + 4 * c4), u + (size_t)r * dv + 4 * c4, true);
    }
    cp_async_commit();
  };
  auto issue_qkp = [&](int c) {  // Q, K rows (zeros outside the call), P, Γ and dec of chunk c
    const size_t blk = (size_t)c * Hv + h;
    const int t0 = c * GC_CHUNK - lead;
    for (int idx = tid; idx < GC_CHUNK * (DK / 4); idx += blockDim.x) {
      const int r = idx / (DK / 4), d4 = idx % (DK / 4), t = t0 + r;
      const bool ok = t >= 0 && t < T;
      const size_t src = ok ? ((size_t)t * Hk + kh) * DK + 4 * d4 : 0;
      cp_async16(smem_u32(sQ + r * LK + 4 * d4), q + src, ok);
      cp_async16(smem_u32(sK + r * LK + 4 * d4), k + src, ok);
    }
    const float* p = ws_p + blk * GC_CHUNK * GC_CHUNK;
    for (int idx = tid; idx < GC_CHUNK * 16; idx += blockDim.x) {
      const int r = idx / 16, c4 = idx % 16;
      cp_async16(smem_u32(sP + r * GC_LA + 4 * c4), p + r * GC_CHUNK + 4 * c4, true);
    }
    if (tid < 2 * GC_CHUNK / 4) cp_async16(smem_u32(sGD + 4 * tid), ws_gd + blk * 2 * GC_CHUNK + 4 * tid, true);
    cp_async_commit();
  };

  for (int idx = tid; idx < DK * 16; idx += blockDim.x) {
    const int r = idx / 16, c4 = idx % 16;
    *reinterpret_cast<float4*>(sS + r * GC_LA + 4 * c4) = *reinterpret_cast<const float4*>(st + (size_t)r * dv + 4 * c4);
  }
  issue_wu(0);
  issue_qkp(0);
  __syncthreads();
  // The state's tiles in this warp's accumulators: tile w · NS + e is row tile (w NS + e) / 8, column tile (.) % 8.
  const int sm0 = 16 * ((warp * NS) / 8);
  float s[NS][4];
#pragma unroll
  for (int e = 0; e < NS; ++e)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      s[e][i] = sS[acc_row(sm0, gid, i) * GC_LA + acc_col(8 * ((warp * NS + e) % 8), tig, i)];
  const int om0 = 16 * (warp >> 1), on0 = 32 * (warp & 1);  // this warp's Δ / O tiles: rows om0.., 4 column tiles

  for (int c = 0; c < num_chunks; ++c) {
    cp_async_wait<1>();  // W, U of chunk c (Q, K, P may still be in flight)
    __syncthreads();
    {  // Δ = U - W S
      float d[4][4] = {};
      for (int k0 = 0; k0 < DK; k0 += 8) {
        const FragA<SPLIT> a = load_a<SPLIT>(sW, LK, om0, k0, gid, tig);
#pragma unroll
        for (int e = 0; e < 4; ++e) mma_acc<SPLIT>(d[e], a, load_b<SPLIT>(sS, GC_LA, nullptr, k0, on0 + 8 * e, gid, tig));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int at = acc_row(om0, gid, i) * GC_LA + acc_col(on0 + 8 * e, tig, i);
          sD[at] = sU[at] - d[e][i];
        }
    }
    cp_async_wait<0>();  // Q, K, P of chunk c
    __syncthreads();     // Δ complete; sW and sU free
    if (c + 1 < num_chunks) issue_wu(c + 1);
    {  // O = diag(Γ) Q S + P Δ -> y
      float o[4][4] = {};
      for (int k0 = 0; k0 < DK; k0 += 8) {
        const FragA<SPLIT> a = load_a<SPLIT>(sQ, LK, om0, k0, gid, tig);
#pragma unroll
        for (int e = 0; e < 4; ++e) mma_acc<SPLIT>(o[e], a, load_b<SPLIT>(sS, GC_LA, nullptr, k0, on0 + 8 * e, gid, tig));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[e][i] *= sGD[acc_row(om0, gid, i)];
      for (int k0 = 0; k0 < om0 + 16; k0 += 8) {  // P is lower triangular
        const FragA<SPLIT> a = load_a<SPLIT>(sP, GC_LA, om0, k0, gid, tig);
#pragma unroll
        for (int e = 0; e < 4; ++e) mma_acc<SPLIT>(o[e], a, load_b<SPLIT>(sD, GC_LA, nullptr, k0, on0 + 8 * e, gid, tig));
      }
      const int t0 = c * GC_CHUNK - lead;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = t0 + acc_row(om0, gid, 2 * half);
        if (t >= 0 && t < T) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            *reinterpret_cast<float2*>(y + ((size_t)t * Hv + h) * dv + col0 + acc_col(on0 + 8 * e, tig, 0)) =
                make_float2(o[e][2 * half], o[e][2 * half + 1]);
        }
      }
    }
    {  // S' = Γ_63 S + (diag(dec) K)ᵀ Δ, in the accumulators
      const float last = sGD[GC_CHUNK - 1];
#pragma unroll
      for (int e = 0; e < NS; ++e)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[e][i] *= last;
      for (int k0 = 0; k0 < GC_CHUNK; k0 += 8) {
        const FragA<SPLIT> a = load_a_t<SPLIT>(sK, LK, sGD + GC_CHUNK, sm0, k0, gid, tig);
#pragma unroll
        for (int e = 0; e < NS; ++e)
          mma_acc<SPLIT>(s[e], a, load_b<SPLIT>(sD, GC_LA, nullptr, k0, 8 * ((warp * NS + e) % 8), gid, tig));
      }
    }
    __syncthreads();  // every read of sS, sQ, sK, sP, sD, sGD done
#pragma unroll
    for (int e = 0; e < NS; ++e)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sS[acc_row(sm0, gid, i) * GC_LA + acc_col(8 * ((warp * NS + e) % 8), tig, i)] = s[e][i];
    if (c + 1 < num_chunks) issue_qkp(c + 1);
  }
#pragma unroll
  for (int e = 0; e < NS; ++e)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      st[(size_t)acc_row(sm0, gid, i) * dv + acc_col(8 * ((warp * NS + e) % 8), tig, i)] = s[e][i];
  if (blockIdx.x == 0 && blockIdx.y == 0) {  // the conv tail: the last K-1 rows of [tail; mixed], rows in order
    for (int ch = tid; ch < channels; ch += blockDim.x)
      for (int r = 0; r < tail_rows; ++r) {
        const int src = r + T;
        tail[(size_t)r * channels + ch] = src < tail_rows ? tail[(size_t)src * channels + ch]
                                                          : mixed[(size_t)(src - tail_rows) * channels + ch];
      }
  }
}

#define GDN_CHUNK_KERNELS(NAME, DK, SPLIT)                                                                         \
  extern "C" __global__ void __launch_bounds__(128) gdn_chunk_prep##NAME(                                          \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                       \
      const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ ws_w,                       \
      float* __restrict__ ws_u, float* __restrict__ ws_p, float* __restrict__ ws_gd, int T, int lead, int Hk,       \
      int Hv, int dv) {                                                                                            \
    PDL_ENTER                                                                                                      \
    gdn_chunk_prep_impl<DK, SPLIT>(q, k, v, g, beta, ws_w, ws_u, ws_p, ws_gd, T, lead, Hk, Hv, dv);              \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(256, 1) gdn_chunk_scan##NAME(                                       \
      const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ ws_w,                    \
      const float* __restrict__ ws_u, const float* __restrict__ ws_p, const float* __restrict__ ws_gd,             \
      float* __restrict__ state, float* __restrict__ y, int T, int lead, int Hk, int Hv, int dv,                   \
      float* __restrict__ tail, const float* __restrict__ mixed, int tail_rows, int channels) {                    \
    PDL_ENTER                                                                                                      \
    gdn_chunk_scan_impl<DK, SPLIT>(q, k, ws_w, ws_u, ws_p, ws_gd, state, y, T, lead, Hk, Hv, dv, tail, mixed,     \
                                   tail_rows, channels);                                                           \
  }
GDN_CHUNK_KERNELS(32x3, 32, 3)
GDN_CHUNK_KERNELS(64x3, 64, 3)
GDN_CHUNK_KERNELS(128x3, 128, 3)
GDN_CHUNK_KERNELS(32x1, 32, 1)
GDN_CHUNK_KERNELS(64x1, 64, 1)
GDN_CHUNK_KERNELS(128x1, 128, 1)
