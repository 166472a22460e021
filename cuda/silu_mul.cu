// silu_mul.cu: y = silu(gate) · up = gate / (1 + exp(-gate)) · up, elementwise (the MLP's activation;
// reference: numpy_ops.silu(gate) * up). Accurate expf (no fast math): within 2 ulp of the reference.
// Launch: grid ceil(n / 256) (capped, grid-stride), block 256. Layout: gate, up, y [n] fp32 (any shape, flat).
// History: v1 scalar grid-stride.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
silu_mul(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ y, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float g = gate[i];
    y[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
  }
}
