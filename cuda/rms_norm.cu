// rms_norm.cu: zero-centred RMSNorm y = x · (1 / sqrt(mean(x²) + eps)) · weight over the last axis, and the
// fused residual form x += delta; y = rms_norm(x) (reference: numpy_ops.rms_norm; weight is already 1 + w).
// Launch: grid rows, block 256; one block per row, the sum of squares in a fixed order (per-thread strided
// fmaf, then block_sum), so a row's bits never depend on how many rows the launch holds.
// Layout: x, delta, y [rows, cols] fp32 row-major; weight [cols] fp32.
// History: v1 block per row.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, const float* __restrict__ weight, float* __restrict__ y, int cols,
         float eps) {
  __shared__ float scratch[32];
  const float* xr = x + (size_t)blockIdx.x * cols;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
  const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)cols + eps);
  float* yr = y + (size_t)blockIdx.x * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = __fmul_rn(__fmul_rn(xr[c], inv), weight[c]);
}

// x := x + delta (the residual stream, in place), then y = rms_norm(x).
extern "C" __global__ void __launch_bounds__(256)
add_rms_norm(float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ weight,
             float* __restrict__ y, int cols, float eps) {
  __shared__ float scratch[32];
  float* xr = x + (size_t)blockIdx.x * cols;
  const float* dr = delta + (size_t)blockIdx.x * cols;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float s = __fadd_rn(xr[c], dr[c]);
    xr[c] = s;
    ss = fmaf(s, s, ss);
  }
  const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)cols + eps);
  float* yr = y + (size_t)blockIdx.x * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = __fmul_rn(__fmul_rn(xr[c], inv), weight[c]);
}
