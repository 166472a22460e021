// embed.cu: embedding rows of BF16 bits widened to fp32 (exact): out[t, :] = f32(bits[ids[t], :])
// (reference: tandem/backend/cuda/embed.py `reference` = tandem.dtypes.bf16_to_f32 of the gathered rows).
// embed_bf16      grid (ceil(E / 256), T), block 256; ids [T] int32 on the device.
// embed_bf16_one  the same for one token passed by value (decode: no host-to-device copy of the id).
// History: v1.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
embed_bf16(const u16* __restrict__ bits, const int* __restrict__ ids, float* __restrict__ out, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
  if (c < cols) out[(size_t)t * cols + c] = bf16_lo(bits[(size_t)ids[t] * cols + c]);
}

extern "C" __global__ void __launch_bounds__(256)
embed_bf16_one(const u16* __restrict__ bits, int token, float* __restrict__ out, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < cols) out[c] = bf16_lo(bits[(size_t)token * cols + c]);
}
