// attention_common.cuh: the arithmetic that decode (attention_decode.cu) and tree verify (attention_tree.cu) share,
// so a tree node's output has the bits of a decode at its position (DESIGN.md, "Exactness"). Every function's
// result depends only on its inputs and the absolute chunk, never on S, N, blockDim or which warp runs it.
//
// Chunks: key rows at absolute positions [64c, 64c + 64). Within a chunk, for each query row:
//   score_p = warp_sum(lane chain of fmaf over float4 e = lane, lane + 32 of k_p · q) · D^-1/2   (chunk_dot)
//   m = max_p score_p; e_p = expf(score_p - m); l = warp_sum(e_lane + e_lane+32)                  (chunk_softmax)
//   acc[d] = fmaf chain over p = 0, 1, ... n - 1 of e_p · v_p[d]                                  (callers, in order)
// KV rows are stored as KV = float or kv_bf16 (bfloat16 bits): written rounded to nearest even (kv_store, the
// bits of tandem/dtypes.py f32_to_bf16), widened exactly when read (kv_load, load_row4, load_kv4), so every score
// and weighted sum above runs on the stored values in fp32 with the same arithmetic for either storage.
// History: v1 (this file) 64-row chunks; warp-per-head RMSNorm + RoPE. v2 lane_dot_regs and warp_sum_each (the
// same arithmetic for many scores a warp: attention_tree.cu's prefill_partial). v3 KV storage in float or bf16.

#define ATTN_CHUNK 64
#define ATTN_THREADS 256
#define ATTN_WARPS (ATTN_THREADS / 32)
#define ATTN_ROWS_PER_WARP (ATTN_CHUNK / ATTN_WARPS)  // 8 key rows per warp in the score phase
#define ATTN_MAX_D4 64                                // D ≤ 256: ≤ 2 float4 per lane

// ---- KV storage: float (fp32 rows) or kv_bf16 (bfloat16 bits) ----
struct kv_bf16 {
  u16 bits;
};
// float32 -> bfloat16 bits, round to nearest even; a NaN becomes sign | 0x7FC0 (tandem/dtypes.py f32_to_bf16).
__device__ __forceinline__ u16 kv_bf16_bits(float x) {
  const u32 b = __float_as_uint(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (u16)(((b >> 16) & 0x8000u) | 0x7FC0u);
  return (u16)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const kv_bf16* p) { return bf16_lo(p->bits); }
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_store(kv_bf16* p, float x) { p->bits = kv_bf16_bits(x); }
// The value a KV row of storage KV holds for x (x itself for float).
template <typename KV>
__device__ __forceinline__ float kv_round(float x) {
  if constexpr (sizeof(KV) == 4) {
    return x;
  } else {
    return bf16_lo(kv_bf16_bits(x));
  }
}
// Four consecutive stored values at p (16-byte aligned for float, 8-byte for bf16), widened.
template <typename KV>
__device__ __forceinline__ float4 load_kv4(const KV* p) {
  if constexpr (sizeof(KV) == 4) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y));
  }
}

// RMSNorm (weight w) and partial RoPE (first rotary_dim channels, half rotation, angle = f32(pos) · inv_freq[i])
// of one head of head_dim channels, by one warp. Lane holds channels lane + 32 i; the sum of squares runs over i
// in order, then warp_sum. stage: head_dim floats of shared memory owned by this warp. Writes, each when not
// null, dst (floats: the value a KV row of storage KV holds, kv_round; KV = float for a query head) and dst2 (a
// stored row of KV, kv_store), either of which may be shared or global.
template <typename KV>
__device__ __forceinline__ void norm_rope_head(const float* __restrict__ src, const float* __restrict__ w,
                                               const float* __restrict__ inv_freq, int head_dim, int rotary_dim,
                                               int pos, float eps, float* stage, float* dst, KV* dst2) {
  const int lane = threadIdx.x & 31;
  float x[8];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[i] = 32 * i < head_dim ? src[lane + 32 * i] : 0.0f;
    ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
  }
  ss = warp_sum(ss);
  const float inv = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(ss, (float)head_dim), eps)));
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (32 * i < head_dim) stage[lane + 32 * i] = __fmul_rn(__fmul_rn(x[i], inv), w[lane + 32 * i]);
  __syncwarp();
  const int half = rotary_dim / 2;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane + 32 * i;
    if (d >= head_dim) continue;
    const float nx = stage[d];
    float out = nx;
    if (d < rotary_dim) {
      const int f = d < half ? d : d - half;
      const float ang = __fmul_rn((float)pos, inv_freq[f]);
      const float c = cosf(ang), s = sinf(ang);
      out = d < half ? __fsub_rn(__fmul_rn(nx, c), __fmul_rn(stage[d + half], s))
                     : __fadd_rn(__fmul_rn(nx, c), __fmul_rn(stage[d - half], s));
    }
    if (dst != nullptr) dst[d] = kv_round<KV>(out);
    if (dst2 != nullptr) kv_store(dst2 + d, out);
  }
  __syncwarp();  // stage may be reused by the caller
}

// This lane's part of k · q: fmaf chain over float4 e = lane, lane + 32 (e < d4), channels x, y, z, w in order.
__device__ __forceinline__ float lane_dot(const float4 (&kk)[2], const float* __restrict__ qq, int d4, int lane) {
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = lane + 32 * i;
    if (e < d4) {
      const float4 q4 = *reinterpret_cast<const float4*>(qq + 4 * e);
      dot = fmaf(kk[i].x, q4.x, dot);
      dot = fmaf(kk[i].y, q4.y, dot);
      dot = fmaf(kk[i].z, q4.z, dot);
      dot = fmaf(kk[i].w, q4.w, dot);
    }
  }
  return dot;
}

// lane_dot with this lane's q float4s already in registers (q4[i]: float4 e = lane + 32 i; read only for e < d4):
// the same fmaf chain, operand for operand, so the same bits.
__device__ __forceinline__ float lane_dot_regs(const float4 (&kk)[2], const float4 (&q4)[2], int d4, int lane) {
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (lane + 32 * i < d4) {
      dot = fmaf(kk[i].x, q4[i].x, dot);
      dot = fmaf(kk[i].y, q4[i].y, dot);
      dot = fmaf(kk[i].z, q4[i].z, dot);
      dot = fmaf(kk[i].w, q4[i].w, dot);
    }
  }
  return dot;
}

// warp_sum of 32 values at once, one result a lane: lane l returns warp_sum(v[l]) (every lane's v[l]) with warp_sum's
// bits. Step m (16, 8, 4, 2, 1, warp_sum's masks in its order) adds the value of lane ^ m to this lane's, as the
// butterfly does (fp add is commutative), for the half of the remaining sums this lane keeps: lane bit m set keeps
// the upper half. 31 shuffles for 32 sums (warp_sum: 5 each). v is overwritten.
template <int M>
__device__ __forceinline__ void warp_sum_each_step(float (&v)[32], int lane) {
  const bool upper = (lane & M) != 0;
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float keep = upper ? v[i + M] : v[i];
    const float send = upper ? v[i] : v[i + M];
    v[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, M);
  }
}
__device__ __forceinline__ float warp_sum_each(float (&v)[32], int lane) {
  warp_sum_each_step<16>(v, lane);
  warp_sum_each_step<8>(v, lane);
  warp_sum_each_step<4>(v, lane);
  warp_sum_each_step<2>(v, lane);
  warp_sum_each_step<1>(v, lane);
  return v[0];
}

// One key row's float4s for this lane (zeros past d4), widened from the row's storage KV. CG: through L2 only
// (__ldcg), for rows read before pdl_wait (common.cuh PDL rule 2: L1 is not coherent).
template <bool CG = false, typename KV = float>
__device__ __forceinline__ void load_row4(const KV* row, int d4, int lane, float4 (&kk)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = lane + 32 * i;
    if constexpr (sizeof(KV) == 4) {
      const float4* p = reinterpret_cast<const float4*>(row) + e;
      kk[i] = e < d4 ? (CG ? __ldcg(p) : *p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    } else {
      const uint2* p = reinterpret_cast<const uint2*>(row) + e;
      const uint2 u = e < d4 ? (CG ? __ldcg(p) : *p) : make_uint2(0u, 0u);
      kk[i] = make_float4(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y));
    }
  }
}

// The scaled score of one key row for one query row (every lane gets it).
__device__ __forceinline__ float chunk_dot(const float4 (&kk)[2], const float* __restrict__ qq, int d4, int lane,
                                           float scale) {
  return __fmul_rn(warp_sum(lane_dot(kk, qq, d4, lane)), scale);
}

// Softmax statistics of one query row's n ≤ 64 scores s[0, n), by one warp: m = max, s[p] = expf(s[p] - m),
// l = warp_sum of (e_lane + e_lane+32). n ≤ 0 gives m = -inf, l = 0 (a chunk the row does not reach).
__device__ __forceinline__ void chunk_softmax(float* s, int n, int lane, float& m_out, float& l_out) {
  float m = TANDEM_NEG_INF;
  for (int p = lane; p < n; p += 32) m = fmaxf(m, s[p]);
  m = warp_max(m);
  float l = 0.0f;
  for (int p = lane; p < n; p += 32) {
    const float e = expf(__fsub_rn(s[p], m));
    s[p] = e;
    l = __fadd_rn(l, e);
  }
  m_out = m;
  l_out = warp_sum(l);
}
