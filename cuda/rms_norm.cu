// rms_norm.cu: zero-centred RMSNorm y = x · (1 / sqrt(mean(x²) + eps)) · weight over the last axis, and the
// fused residual form x += delta; y = rms_norm(x) (reference: numpy_ops.rms_norm; weight is already 1 + w).
// Either writes y [rows, cols] fp32, or (split > 0) the next GEMV's operand xs [rows, P, cols] directly
// (common.cuh store_split), which saves the GEMV's prepare launch.
// Launch: grid rows, block NORM_THREADS (256); one block per row, the sum of squares in a fixed order, so a row's
// bits never depend on how many rows the launch holds: rms_norm common.cuh norm_row (per-thread strided fmaf, then
// block_sum; embed.cu's decode norm has the same), add_rms_norm the residual norm's tile order (common.cuh
// norm_row_tiles: 16-column tile sums, then the tiles), so it equals the GEMV's residual + norm epilogue
// (cuda/gemv.cu MMA_Y_RESNORM) bit for bit.
// Layout: x, delta, y [rows, cols] fp32 row-major; weight [cols] fp32.
// History: v1 block per row (256); v2 1024 threads, loads unrolled, split output; v3 back to 256 threads with
// the arithmetic in common.cuh, shared with the GEMV's residual + norm epilogue (decode == verify bits); v4
// add_rms_norm sums s² in the tile order of that epilogue's blocks (the epilogue's norm is spread over blocks).
#include "common.cuh"


extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rms_norm(const float* __restrict__ x, const float* __restrict__ weight, float* __restrict__ y,
         u16* __restrict__ xs, int split, int cols, float eps) {
  PDL_ENTER
  __shared__ float scratch[32];
  const float* xr = x + (size_t)blockIdx.x * cols;
  norm_row<false>(xr, nullptr, nullptr, weight, cols, eps, scratch, blockIdx.x, split, xs, y, nullptr);
}

// x := x + delta (the residual stream, in place), then y = rms_norm(x).
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
add_rms_norm(float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ weight,
             float* __restrict__ y, u16* __restrict__ xs, int split, int cols, float eps) {
  PDL_ENTER
  __shared__ float scratch[32];
  float* xr = x + (size_t)blockIdx.x * cols;
  const float* dr = delta + (size_t)blockIdx.x * cols;
  // the residual norm's tile order (common.cuh norm_row_tiles): the bits of the GEMV's residual + norm epilogue
  norm_row_tiles(xr, dr, weight, cols, eps, scratch, blockIdx.x, split, xs, y, nullptr);
}
