// embed.cu: embedding rows of BF16 bits widened to fp32 (exact): out[t, :] = f32(bits[ids[t], :])
// (reference: tandem/backend/cuda/embed.py `reference` = tandem.dtypes.bf16_to_f32 of the gathered rows).
// embed_bf16      grid (ceil(E / 256), T), block 256; ids [T] int32 on the device.
// embed_bf16_one  the same for one token passed by value (decode: no host-to-device copy of the id).
// embed_bf16_one_norm  grid 1, block NORM_THREADS (256): one token, by value or (token_ptr not null) read from
//                 the device (the previous step's argmax or sampler: the host need not read it first; an id outside
//                 [0, rows) reads row 0 and the host raises on it); its row written to out [1, E] and its RMSNorm
//                 (common.cuh norm_row: rms_norm.cu's bits) written as the first projection's operand xs [1, P, E]
//                 (split kind > 0) or fp32 y [1, E] (kind 0): the decode step's first two launches in one.
// History: v1; v2 embed_bf16_one_norm; v3 its token from a device pointer (the engine runs a step ahead).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
embed_bf16(const u16* __restrict__ bits, const int* __restrict__ ids, float* __restrict__ out, int cols) {
  PDL_ENTER
  const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
  if (c < cols) out[(size_t)t * cols + c] = bf16_lo(bits[(size_t)ids[t] * cols + c]);
}

extern "C" __global__ void __launch_bounds__(256)
embed_bf16_one(const u16* __restrict__ bits, int token, float* __restrict__ out, int cols) {
  PDL_ENTER
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < cols) out[c] = bf16_lo(bits[(size_t)token * cols + c]);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
embed_bf16_one_norm(const u16* __restrict__ bits, int token, const int* __restrict__ token_ptr, int rows,
                    float* __restrict__ out, const float* __restrict__ norm_w, float eps, float* __restrict__ y,
                    u16* __restrict__ xs, int kind, int cols) {
  PDL_ENTER
  if (token_ptr != nullptr) {  // written by the kernel before this one: read after pdl_wait
    token = *token_ptr;
    if (token < 0 || token >= rows) token = 0;  // a sampler's -1 (no candidate): the host raises when it reads it
  }
  __shared__ float scratch[32];
  for (int c = threadIdx.x; c < cols; c += NORM_THREADS) out[c] = bf16_lo(bits[(size_t)token * cols + c]);
  // each thread reads back the columns it wrote (norm_row's columns tid, tid + NORM_THREADS, ...)
  norm_row<true>(out, nullptr, nullptr, norm_w, cols, eps, scratch, 0, kind, xs, y, nullptr);
}
