// silu_mul.cu: y = silu(gate) · up = gate / (1 + exp(-gate)) · up, elementwise (the MLP's activation;
// reference: numpy_ops.silu(gate) * up). Accurate expf (no fast math): within 2 ulp of the reference.
// silu_mul       grid ceil(n / 256) (capped, grid-stride), block 256. gate, up, y [n] fp32 (any shape, flat).
// silu_mul_rows  the same on the fused gate|up projection gu [T, 2F] (gate = columns 0..F-1, up = F..2F-1),
//                writing y [T, F] fp32 or (split > 0) the down projection's operand xs [T, P, F] directly.
// History: v1 scalar grid-stride; v2 silu_mul_rows (fused projection input, split output); v3 silu_times moved to
// common.cuh (the GEMV's gate|up epilogue, cuda/gemv.cu MMA_Y_GLU, uses the same arithmetic).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
silu_mul(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ y, long long n) {
  PDL_ENTER
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    y[i] = silu_times(gate[i], up[i]);
}

extern "C" __global__ void __launch_bounds__(256)
silu_mul_rows(const float* __restrict__ gu, float* __restrict__ y, u16* __restrict__ xs, int split, int rows,
              int width) {
  PDL_ENTER
  const long long n = (long long)rows * width;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(i / width), j = (int)(i % width);
    const float v = silu_times(gu[(size_t)t * 2 * width + j], gu[(size_t)t * 2 * width + width + j]);
    if (split) store_split(xs, t, j, width, v, split);
    else y[i] = v;
  }
}
