// Weights as bf16 for the prefill's GEMMs (tandem/backend/cuda/prefill_gemm.py): a prompt chunk of hundreds to
// thousands of rows runs its projections as cuBLAS bf16 GEMMs with fp32 accumulation over weights dequantised here.
//
// dequant_bf16 / dequant_fp8 / dequant_nvfp4
//                 grid-stride over the stored weight's 16-byte groups, block 256: one group a thread (8 BF16, 16 FP8
//                 or 32 NVFP4 codes of one row) decoded and written as bf16 bits (round to nearest even) into
//                 W [out, in] row-major; the stored layout is the GEMV's (gemv_layout.py: tile-major when `tiled`,
//                 NVFP4 words in the pair layout), read by offset arithmetic, so no untiled copy is kept. FP8:
//                 code · scale8[row / 8, k / 128] (one fp32 rounding), NVFP4: (e2m1 · e4m3 scale) · (row_scale[row] ·
//                 2^-14) (the first product exact, one rounding), then bf16. glu > 0 (a glu_pair Linear, gate and up
//                 rows interleaved in 8-row groups) writes gate rows to 0..glu-1 and up rows to glu..2 glu-1.
// f32_to_b16      grid-stride, block 256: fp32 -> bf16 bits (the fp32 fallback Linear's weight).
// History: v1.
#include "common.cuh"

#define DQ_THREADS 256

// ---- dequantisation to bf16 -------------------------------------------------------------------------------------
// Byte offset of row r's byte b (16-byte aligned) in a stored weight of R bytes a row: tile-major (gemv_layout._tile:
// 16-row tile t, 64-byte chunk q, half h of the tile, row r8 in it, 16-byte piece c) or row-major.
__device__ __forceinline__ size_t dq_offset(int r, int b, int row_bytes, int tiled) {
  if (!tiled) return (size_t)r * row_bytes + b;
  const int t = r >> 4, h = (r >> 3) & 1, r8 = r & 7, q = b >> 6, c = (b >> 4) & 3;
  return ((((size_t)t * (row_bytes >> 6) + q) * 2 + h) * 8 + r8) * 64 + (size_t)c * 16;
}

__device__ __forceinline__ int dq_dest_row(int r, int glu) {
  if (glu == 0) return r;
  const int g = r >> 4, w = r & 15;
  return w < 8 ? g * 8 + w : glu + g * 8 + (w - 8);
}

__device__ __forceinline__ u32 pack_b16(float lo, float hi) {
  return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
}

extern "C" __global__ void __launch_bounds__(DQ_THREADS) dequant_bf16(const uint4* __restrict__ src,
                                                                        u16* __restrict__ dst, int rows, int cols,
                                                                        int tiled, int glu) {
  PDL_ENTER
  const int row_bytes = cols * 2, groups = row_bytes / 16;
  const size_t n = (size_t)rows * groups;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(i / groups), g = (int)(i % groups);
    const uint4 v = src[dq_offset(r, g * 16, row_bytes, tiled) / 16];
    *reinterpret_cast<uint4*>(dst + (size_t)dq_dest_row(r, glu) * cols + g * 8) = v;
  }
}

extern "C" __global__ void __launch_bounds__(DQ_THREADS) dequant_fp8(const uint4* __restrict__ src,
                                                                       const float* __restrict__ scale8,
                                                                       u16* __restrict__ dst, int rows, int cols,
                                                                       int tiled, int glu) {
  PDL_ENTER
  const int row_bytes = cols, groups = row_bytes / 16, scale_cols = (cols + 127) / 128;
  const size_t n = (size_t)rows * groups;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(i / groups), g = (int)(i % groups), k0 = g * 16;
    const uint4 v = src[dq_offset(r, k0, row_bytes, tiled) / 16];
    const float s = scale8[(size_t)(r >> 3) * scale_cols + (k0 >> 7)];
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const u32 word = w[e >> 1], sh = (e & 1) * 16;
      o[e] = pack_b16(e4m3_to_f32((word >> sh) & 0xFF) * s, e4m3_to_f32((word >> (sh + 8)) & 0xFF) * s);
    }
    uint4* d = reinterpret_cast<uint4*>(dst + (size_t)dq_dest_row(r, glu) * cols + k0);
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

// Element j (0..7) of a 32-bit word of NVFP4 codes: in the pair layout (gemv_layout.PAIR_SLOTS, paired) or as the
// checkpoint packs them (nibble j), as a float (E2M1, bit 3 the sign).
__device__ __forceinline__ float nvfp4_elem(u32 w, int j, int paired) {
  u32 code;
  if (paired) {
    const int half = j >> 2, k = j & 3;
    const int mag = (k == 0 ? 9 : k == 1 ? 6 : k == 2 ? 0 : 3) + 16 * half;
    const int sgn = (k == 0 ? 15 : k == 1 ? 12 : k == 2 ? 13 : 14) + 16 * half;
    code = ((w >> mag) & 7u) | (((w >> sgn) & 1u) << 3);
  } else {
    code = (w >> (4 * j)) & 15u;
  }
  return e2m1_to_f32(code);
}

extern "C" __global__ void __launch_bounds__(DQ_THREADS) dequant_nvfp4(const uint4* __restrict__ src,
                                                                         const unsigned char* __restrict__ scales,
                                                                         const float* __restrict__ row_scale,
                                                                         u16* __restrict__ dst, int rows, int cols,
                                                                         int tiled, int glu) {
  PDL_ENTER
  const int row_bytes = cols / 2, groups = row_bytes / 16;
  const size_t n = (size_t)rows * groups;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(i / groups), g = (int)(i % groups), k0 = g * 32;
    const uint4 v = src[dq_offset(r, g * 16, row_bytes, tiled) / 16];
    const float rs = row_scale[r] * 6.103515625e-05f;  // · 2^-14 (the GEMV's fp16 decode carries 2^14): exact
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u16* d = dst + (size_t)dq_dest_row(r, glu) * cols + k0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // 16 elements share one E4M3 scale
      const int grp = (k0 >> 4) + half;
      const size_t si = tiled ? ((((size_t)(r >> 4) * (cols >> 7) + (grp >> 3)) * 16 + (r & 15)) * 8 + (grp & 7))
                              : (size_t)r * (cols >> 4) + grp;
      const float sc = e4m3_to_f32(scales[si]);
      u32 o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int j0 = 2 * e, j1 = 2 * e + 1;
        const u32 word = w[half * 2 + (j0 >> 3)];
        o[e] = pack_b16(nvfp4_elem(word, j0 & 7, tiled) * sc * rs, nvfp4_elem(word, j1 & 7, tiled) * sc * rs);
      }
      uint4* dv = reinterpret_cast<uint4*>(d + half * 16);
      dv[0] = make_uint4(o[0], o[1], o[2], o[3]);
      dv[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(DQ_THREADS) f32_to_b16(const float* __restrict__ src,
                                                                      u16* __restrict__ dst, long long n) {
  PDL_ENTER
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = f32_to_bf16_bits(src[i]);
}

