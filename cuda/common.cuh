// common.cuh: device helpers shared by the kernels, inlined by the loader (tandem/backend/cuda/loader.py)
// in place of `#include "common.cuh"`, so the source hash that keys the compile cache covers them.
//
// Decoders widen stored weight bits to float32 exactly (the NumPy tables in tandem/dtypes.py are the reference).
// Reductions run in a fixed order that depends only on blockDim, never on the data or on how many rows a launch
// holds (DESIGN.md, "matrix rows").
// History: v1 bf16 / e4m3 / e2m1 decoders, warp and block sums.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define TANDEM_NAN __uint_as_float(0x7FC00000u)
#define TANDEM_NEG_INF __uint_as_float(0xFF800000u)

// bfloat16 bits (in the low 16 bits of `bits`) -> float32: the top half of a float32.
__device__ __forceinline__ float bf16_lo(u32 bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float bf16_hi(u32 bits) { return __uint_as_float(bits & 0xFFFF0000u); }

// float8_e4m3fn code -> float32 (spec §9): normals by moving the fields, subnormals m * 2^-9, S.1111.111 = NaN.
__device__ __forceinline__ float e4m3_to_f32(u32 c) {
  u32 em = c & 0x7Fu;
  float v = em >= 8u ? __uint_as_float((em + 960u) << 20) : (float)em * 0.001953125f;
  if (em == 0x7Fu) v = TANDEM_NAN;
  return __uint_as_float(__float_as_uint(v) | ((c & 0x80u) << 24));
}

// E2M1 nibble -> float32 (spec §10.1): bit 3 sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float e2m1_to_f32(u32 n) {
  u32 em = n & 7u;
  float v = em >= 2u ? __uint_as_float((em + 252u) << 22) : (float)em * 0.5f;
  return __uint_as_float(__float_as_uint(v) | ((n & 8u) << 28));
}

// Butterfly sum over a full warp: every lane ends with the same bits (fp add is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  return v;
}

// Sum over the block (blockDim a multiple of 32, at most 1024); every thread gets the result.
// scratch: 32 floats of shared memory, reusable right after the call returns in every thread.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_sum(t);
}
