// gemv.cu: y[t, o] = Σ_j x[t, j] · W[o, j] for 1..64 rows of x (GEMV and skinny GEMM), weights in BF16,
// FP8 E4M3 with 128×128 block scales, or NVFP4 (E2M1 low nibble first, E4M3 scale per 16, fp32 global scale).
// fp32 activations and fp32 accumulation; weights decoded to the exact float32 the NumPy reference
// dequantizes to (tandem/formats/linear.py, nvfp4.py): FP8 w = f32(code)·scale, NVFP4 w = (e2m1·e4m3)·global
// (or / global for compressed-tensors), each one float32 product as in the reference.
//
// Launch: grid (ceil(out / 16), ceil(T / TT)), block 256 = 8 warps; a warp owns 2 output rows, TT rows of x.
// Each lane reads 16-byte weight vectors v = lane, lane + 32, ... of its two rows (coalesced, read once per
// row tile of x) and accumulates with fmaf in j order; then a butterfly warp sum.
// Row invariance: the j-partition over lanes, the per-lane order and the warp sum depend only on `in`, so row
// t of y has the same bits for any T and any TT (TT only picks how many rows share one weight read).
// Layout: x [T, in] fp32 row-major, y [T, out] fp32; BF16 W [out, in] u16; FP8 W [out, in] u8 + scale
// [ceil(out/128), ceil(in/128)] fp32; NVFP4 W [out, in/2] u8 + scale [out, in/16] u8 (E4M3 bits) + global.
// Needs: in % 8 (BF16), in % 16 (FP8), in % 32 (NVFP4) == 0, 16-byte aligned rows.
// History: v1 one warp per 2 rows, TT ∈ {1, 2, 4, 8}, rows beyond TT by grid.y (weights re-read per tile).
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_ROWS 2  // output rows per warp: each x load serves two weight rows

// acc[i][r] += Σ_e w[i][e] · x[r][j0 + e], e in order; x read as float4.
template <int TT, int EPV>
__device__ __forceinline__ void fma_vec(float (&acc)[GEMV_ROWS][TT], const float (&w)[GEMV_ROWS][EPV],
                                        const float* const (&xr)[TT], int j0) {
#pragma unroll
  for (int r = 0; r < TT; ++r) {
    const float4* xv = reinterpret_cast<const float4*>(xr[r] + j0);
#pragma unroll
    for (int q = 0; q < EPV / 4; ++q) {
      const float4 a = __ldg(xv + q);
#pragma unroll
      for (int i = 0; i < GEMV_ROWS; ++i) {
        acc[i][r] = fmaf(w[i][4 * q + 0], a.x, acc[i][r]);
        acc[i][r] = fmaf(w[i][4 * q + 1], a.y, acc[i][r]);
        acc[i][r] = fmaf(w[i][4 * q + 2], a.z, acc[i][r]);
        acc[i][r] = fmaf(w[i][4 * q + 3], a.w, acc[i][r]);
      }
    }
  }
}

template <int TT>
__device__ __forceinline__ void store_rows(float (&acc)[GEMV_ROWS][TT], float* __restrict__ y, int out_dim,
                                           int num_rows, int row0, int o0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
    for (int r = 0; r < TT; ++r) acc[i][r] = warp_sum(acc[i][r]);
#pragma unroll
  for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
    for (int r = 0; r < TT; ++r)
      if (lane == i * TT + r && o0 + i < out_dim && row0 + r < num_rows)
        y[(size_t)(row0 + r) * out_dim + o0 + i] = acc[i][r];
}

// Shared prologue: this warp's output rows (clamped for loads) and x row pointers (clamped to the last row).
#define GEMV_PROLOGUE                                                                   \
  const int o0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_ROWS;            \
  if (o0 >= out_dim) return;                                                            \
  const int lane = threadIdx.x & 31;                                                    \
  const int row0 = blockIdx.y * TT;                                                     \
  int orow[GEMV_ROWS];                                                                  \
  _Pragma("unroll") for (int i = 0; i < GEMV_ROWS; ++i) orow[i] = min(o0 + i, out_dim - 1); \
  const float* xr[TT];                                                                  \
  _Pragma("unroll") for (int r = 0; r < TT; ++r)                                        \
    xr[r] = x + (size_t)min(row0 + r, num_rows - 1) * in_dim;                           \
  float acc[GEMV_ROWS][TT];                                                             \
  _Pragma("unroll") for (int i = 0; i < GEMV_ROWS; ++i)                                 \
    _Pragma("unroll") for (int r = 0; r < TT; ++r) acc[i][r] = 0.0f;

template <int TT>
__device__ __forceinline__ void gemv_bf16(const uint4* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int out_dim, int in_dim, int num_rows) {
  GEMV_PROLOGUE
  const int num_vec = in_dim / 8;
#pragma unroll 2
  for (int v = lane; v < num_vec; v += 32) {
    float wf[GEMV_ROWS][8];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
      const uint4 p = __ldg(w + (size_t)orow[i] * num_vec + v);
      const u32 words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        wf[i][2 * q] = bf16_lo(words[q]);
        wf[i][2 * q + 1] = bf16_hi(words[q]);
      }
    }
    fma_vec<TT, 8>(acc, wf, xr, v * 8);
  }
  store_rows<TT>(acc, y, out_dim, num_rows, row0, o0);
}

template <int TT>
__device__ __forceinline__ void gemv_fp8(const uint4* __restrict__ w, const float* __restrict__ scale,
                                         const float* __restrict__ x, float* __restrict__ y, int out_dim,
                                         int in_dim, int num_rows) {
  GEMV_PROLOGUE
  const int num_vec = in_dim / 16;
  const int scale_cols = (in_dim + 127) / 128;
#pragma unroll 2
  for (int v = lane; v < num_vec; v += 32) {
    float wf[GEMV_ROWS][16];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
      const uint4 p = __ldg(w + (size_t)orow[i] * num_vec + v);
      const float s = __ldg(scale + (size_t)(orow[i] / 128) * scale_cols + (v * 16) / 128);
      const u32 words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int e = 0; e < 16; ++e) wf[i][e] = __fmul_rn(e4m3_to_f32((words[e / 4] >> (8 * (e % 4))) & 0xFFu), s);
    }
    fma_vec<TT, 16>(acc, wf, xr, v * 16);
  }
  store_rows<TT>(acc, y, out_dim, num_rows, row0, o0);
}

template <int TT>
__device__ __forceinline__ void gemv_nvfp4(const uint4* __restrict__ w, const u16* __restrict__ scale,
                                           float global_scale, int divide, const float* __restrict__ x,
                                           float* __restrict__ y, int out_dim, int in_dim, int num_rows) {
  GEMV_PROLOGUE
  const int num_vec = in_dim / 32;  // 16 bytes = 32 codes = 2 scale groups
#pragma unroll 1
  for (int v = lane; v < num_vec; v += 32) {
    float wf[GEMV_ROWS][32];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
      const uint4 p = __ldg(w + (size_t)orow[i] * num_vec + v);
      const u32 sc = __ldg(scale + (size_t)orow[i] * num_vec + v);  // two E4M3 codes, group 2v low byte
      const float s0 = e4m3_to_f32(sc & 0xFFu), s1 = e4m3_to_f32(sc >> 8);
      const u32 words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const float m = __fmul_rn(e2m1_to_f32((words[e / 8] >> (4 * (e % 8))) & 0xFu), e < 16 ? s0 : s1);
        wf[i][e] = divide ? __fdiv_rn(m, global_scale) : __fmul_rn(m, global_scale);
      }
    }
    fma_vec<TT, 32>(acc, wf, xr, v * 32);
  }
  store_rows<TT>(acc, y, out_dim, num_rows, row0, o0);
}

#define GEMV_INSTANCES(TT)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) gemv_bf16_t##TT(                                           \
      const uint4* w, const float* x, float* y, int out_dim, int in_dim, int num_rows) {                      \
    gemv_bf16<TT>(w, x, y, out_dim, in_dim, num_rows);                                                         \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256) gemv_fp8_t##TT(                                            \
      const uint4* w, const float* scale, const float* x, float* y, int out_dim, int in_dim, int num_rows) {  \
    gemv_fp8<TT>(w, scale, x, y, out_dim, in_dim, num_rows);                                                   \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256) gemv_nvfp4_t##TT(                                          \
      const uint4* w, const u16* scale, float global_scale, int divide, const float* x, float* y, int out_dim, \
      int in_dim, int num_rows) {                                                                              \
    gemv_nvfp4<TT>(w, scale, global_scale, divide, x, y, out_dim, in_dim, num_rows);                           \
  }

GEMV_INSTANCES(1)
GEMV_INSTANCES(2)
GEMV_INSTANCES(4)
GEMV_INSTANCES(8)
