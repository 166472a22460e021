// Causal gated attention for a prefill chunk on tensor cores (tandem/backend/cuda/attention_flash.py).
//
// flash_prefill<D>{,_bf16}
//                 grid (ceil(T / 64), H), block 128 = 4 warps of 16 query rows of head h, dynamic shared memory
//                 3 · 64 · (D + 8) bf16 (Q, the K tile, the V tile; rows padded 16 bytes against bank conflicts).
//                 Query rows t0..t0+63 of the chunk (positions start + t) over key tiles of the absolute positions
//                 [64 j, 64 j + 64), j = 0, 1, ... in order, up to the row's own; S = Q Kᵀ and O += P V on
//                 mma.sync m16n8k16 (bf16 operands: q, K and V rounded to bf16, fp32 accumulators); an online
//                 softmax in base 2 per row (row max over the tile, p = 2^(s·scale·log2 e - m), l in fp32). Keys past
//                 a row's position are masked (p = 0); key rows at or past start + T are read as zeros. The output
//                 y = (O / l) · σ(gate) (gate = qg[t, h, D:2D]) is written as fp32 y or (kind > 0) the next GEMM's
//                 operand (common.cuh store_split). A row's tiles and their order depend on its position alone,
//                 and the MMA computes each row from its own A row, so a row's bits do not depend on the chunk
//                 (docs/architecture.md, "Exactness").
// History: v1.
#include "common.cuh"
#include "attention_common.cuh"
#include "mma.cuh"

#define FA_BM 64
#define FA_BN 64
#define FA_WARPS 4
#define FA_PAD 8

// Eight consecutive values of a key / value row as bf16 bits into shared memory (zeros when !valid).
template <typename KV>
__device__ __forceinline__ void fa_load8(u16* dst, const KV* src, bool valid) {
  if constexpr (sizeof(KV) == 4) {
    uint4 o = make_uint4(0, 0, 0, 0);
    if (valid) {
      const float4 a = *reinterpret_cast<const float4*>(src), b = *reinterpret_cast<const float4*>(src + 4);
      o = make_uint4(pack_bf16_rn(a.x, a.y), pack_bf16_rn(a.z, a.w), pack_bf16_rn(b.x, b.y), pack_bf16_rn(b.z, b.w));
    }
    *reinterpret_cast<uint4*>(dst) = o;
  } else {
    cp_async16(smem_u32(dst), src, valid);
  }
}

template <int D, typename KV>
__device__ __forceinline__ void flash_prefill_impl(const float* __restrict__ q, const KV* __restrict__ k_cache,
                                                   const KV* __restrict__ v_cache, const float* __restrict__ qg,
                                                   float* __restrict__ y, u16* __restrict__ xs, int kind, int T,
                                                   int H, int Hkv, int start, float scale_log2) {
  constexpr int LD = D + FA_PAD;  // shared row stride in bf16 elements
  constexpr int NT = D / 8;       // output n-tiles of a warp's 16 rows
  extern __shared__ __align__(16) u16 fa_smem[];
  u16* sQ = fa_smem;
  u16* sK = sQ + FA_BM * LD;
  u16* sV = sK + FA_BN * LD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int qb = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int h = blockIdx.y, kvh = h / (H / Hkv);
  const int t0 = qb * FA_BM, kv_len = start + T;
  const int rows_here = min(FA_BM, T - t0);
  // Q rows (fp32 -> bf16), zero past T
  for (int i = threadIdx.x; i < FA_BM * (D / 8); i += blockDim.x) {
    const int r = i / (D / 8), d8 = (i % (D / 8)) * 8;
    uint4 o = make_uint4(0, 0, 0, 0);
    if (r < rows_here) {
      const float* src = q + ((size_t)(t0 + r) * H + h) * D + d8;
      const float4 a = *reinterpret_cast<const float4*>(src), b = *reinterpret_cast<const float4*>(src + 4);
      o = make_uint4(pack_bf16_rn(a.x, a.y), pack_bf16_rn(a.z, a.w), pack_bf16_rn(b.x, b.y), pack_bf16_rn(b.z, b.w));
    }
    *reinterpret_cast<uint4*>(sQ + r * LD + d8) = o;
  }
  const int w_first = t0 + warp * 16;                       // the warp's first row
  const bool w_active = w_first < T;
  const int w_last_pos = start + min(w_first + 15, T - 1);  // the warp's last position
  const int w_tiles = w_active ? w_last_pos / FA_BN + 1 : 0;
  const int tiles = (start + t0 + rows_here - 1) / FA_BN + 1;
  const int pos0 = start + w_first + g, pos1 = pos0 + 8;  // positions of the lane's two rows
  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m0 = TANDEM_NEG_INF, m1 = TANDEM_NEG_INF, l0 = 0.f, l1 = 0.f;
  const u32 q_base = smem_u32(sQ + (warp * 16 + (lane & 15)) * LD + (lane >> 4) * 8);
  for (int j = 0; j < tiles; ++j) {
    __syncthreads();  // the previous tile is consumed
    for (int i = threadIdx.x; i < FA_BN * (D / 8); i += blockDim.x) {
      const int r = i / (D / 8), d8 = (i % (D / 8)) * 8, key = j * FA_BN + r;
      const bool valid = key < kv_len;
      const size_t off = ((size_t)(valid ? key : 0) * Hkv + kvh) * D + d8;
      fa_load8<KV>(sK + r * LD + d8, k_cache + off, valid);
      fa_load8<KV>(sV + r * LD + d8, v_cache + off, valid);
    }
    if constexpr (sizeof(KV) != 4) {
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();
    if (j >= w_tiles) continue;
    // S = Q Kᵀ: 16 rows × 64 keys a warp
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 a0, a1, a2, a3;
      ldsm_x4(q_base + kk * 32, a0, a1, a2, a3);
#pragma unroll
      for (int np = 0; np < 4; ++np) {  // two key n-tiles a load
        const int key = np * 16 + (lane & 7) + (lane >> 4) * 8, dim = kk * 16 + ((lane >> 3) & 1) * 8;
        u32 b0, b1, b2, b3;
        ldsm_x4(smem_u32(sK + key * LD + dim), b0, b1, b2, b3);
        mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
        mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    // mask, scale, row max
    float mx0 = TANDEM_NEG_INF, mx1 = TANDEM_NEG_INF;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = j * FA_BN + n * 8 + 2 * c + e;
        s[n][e] = key <= pos0 ? s[n][e] * scale_log2 : TANDEM_NEG_INF;
        s[n][2 + e] = key <= pos1 ? s[n][2 + e] * scale_log2 : TANDEM_NEG_INF;
        mx0 = fmaxf(mx0, s[n][e]);
        mx1 = fmaxf(mx1, s[n][2 + e]);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    // a row that saw no key yet (a padding row past T only) keeps m = -inf: use 0 so no inf - inf appears
    const float base0 = mn0 == TANDEM_NEG_INF ? 0.f : mn0, base1 = mn1 == TANDEM_NEG_INF ? 0.f : mn1;
    const float al0 = exp2f(m0 - base0), al1 = exp2f(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    float sum0 = 0.f, sum1 = 0.f;
    u32 p[4][4];  // P as the A fragments of the four 16-key steps
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float p00 = exp2f(s[n][0] - base0), p01 = exp2f(s[n][1] - base0);
      const float p10 = exp2f(s[n][2] - base1), p11 = exp2f(s[n][3] - base1);
      sum0 += p00 + p01;
      sum1 += p10 + p11;
      p[n >> 1][(n & 1) * 2] = pack_bf16_rn(p00, p01);
      p[n >> 1][(n & 1) * 2 + 1] = pack_bf16_rn(p10, p11);
    }
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
    l0 = l0 * al0 + sum0;
    l1 = l1 * al1 + sum1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      o[n][0] *= al0;
      o[n][1] *= al0;
      o[n][2] *= al1;
      o[n][3] *= al1;
    }
    // O += P V
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      const int key = kb * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        const int dim = np * 16 + (lane >> 4) * 8;
        u32 b0, b1, b2, b3;
        ldsm_x4_t(smem_u32(sV + key * LD + dim), b0, b1, b2, b3);
        mma_bf16(o[2 * np], p[kb][0], p[kb][1], p[kb][2], p[kb][3], b0, b1);
        mma_bf16(o[2 * np + 1], p[kb][0], p[kb][1], p[kb][2], p[kb][3], b2, b3);
      }
    }
  }
  if (!w_active) return;
  const int ta = w_first + g, tb = ta + 8;
  const float inv0 = 1.f / l0, inv1 = 1.f / l1;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int d = n * 8 + 2 * c + e;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = half ? tb : ta;
        if (t >= T) continue;
        const float gate = qg[((size_t)t * H + h) * 2 * D + D + d];
        const float v = o[n][2 * half + e] * (half ? inv1 : inv0) * (1.f / (1.f + expf(-gate)));
        const int col = h * D + d;
        if (kind) store_split(xs, t, col, H * D, v, kind);
        else y[(size_t)t * H * D + col] = v;
      }
    }
  }
}

#define FLASH_PREFILL_KERNEL(NAME, D, KV)                                                                      \
  extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 2) flash_prefill##NAME(                         \
      const float* __restrict__ q, const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,           \
      const float* __restrict__ qg, float* __restrict__ y, u16* __restrict__ xs, int kind, int T, int H,     \
      int Hkv, int start, float scale_log2) {                                                                \
    PDL_ENTER                                                                                                \
    flash_prefill_impl<D, KV>(q, k_cache, v_cache, qg, y, xs, kind, T, H, Hkv, start, scale_log2);           \
  }
#define FLASH_PREFILL_BOTH(D)      \
  FLASH_PREFILL_KERNEL(D, D, float) \
  FLASH_PREFILL_KERNEL(D##_bf16, D, kv_bf16)
FLASH_PREFILL_BOTH(32)
FLASH_PREFILL_BOTH(64)
FLASH_PREFILL_BOTH(96)
FLASH_PREFILL_BOTH(128)
FLASH_PREFILL_BOTH(160)
FLASH_PREFILL_BOTH(192)
FLASH_PREFILL_BOTH(224)
FLASH_PREFILL_BOTH(256)
