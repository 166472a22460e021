// argmax.cu: ids[t] = argmax_j logits[t, j] on the device, so only token ids cross to the host.
// numpy.argmax semantics: the first maximum; a NaN counts as the maximum (the first NaN wins).
// (value, index) pairs form a total order, so the result is the same for any reduction order.
// Launch: argmax_partial grid (num_blocks, T), block 256 -> partials [T, num_blocks];
//         argmax_final grid T, block 256 -> ids [T] int32.
// History: v1 two passes.
#include "common.cuh"

// Whether (a, ia) is preferred to (b, ib).
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  const bool na = a != a, nb = b != b;
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

__device__ __forceinline__ void block_best(float& v, int& i, float* sv, int* si) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, m);
    const int oi = __shfl_xor_sync(0xFFFFFFFFu, i, m);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
      if (better(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
  }
}

extern "C" __global__ void __launch_bounds__(256)
argmax_partial(const float* __restrict__ logits, float* __restrict__ part_val, int* __restrict__ part_idx,
               int vocab) {
  PDL_ENTER
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* row = logits + (size_t)blockIdx.y * vocab;
  float v = TANDEM_NEG_INF;
  int i = 0x7FFFFFFF;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < vocab; j += gridDim.x * blockDim.x) {
    const float x = row[j];
    if (better(x, j, v, i)) { v = x; i = j; }
  }
  block_best(v, i, sv, si);
  if (threadIdx.x == 0) {
    part_val[blockIdx.y * gridDim.x + blockIdx.x] = v;
    part_idx[blockIdx.y * gridDim.x + blockIdx.x] = i;
  }
}

extern "C" __global__ void __launch_bounds__(256)
argmax_final(const float* __restrict__ part_val, const int* __restrict__ part_idx, int* __restrict__ ids,
             int num_parts) {
  PDL_ENTER
  __shared__ float sv[32];
  __shared__ int si[32];
  float v = TANDEM_NEG_INF;
  int i = 0x7FFFFFFF;
  for (int j = threadIdx.x; j < num_parts; j += blockDim.x) {
    const float x = part_val[blockIdx.x * num_parts + j];
    const int xi = part_idx[blockIdx.x * num_parts + j];
    if (better(x, xi, v, i)) { v = x; i = xi; }
  }
  block_best(v, i, sv, si);
  if (threadIdx.x == 0) ids[blockIdx.x] = i;
}
