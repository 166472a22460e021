// vision_mrope.cu: the q / k prep of an image prompt's rows at 3-D rotary positions (tandem/backend/cuda/
// vision_mrope.py; positions and sections: tandem/models/qwen3_5/mrope.py, docs/vision.md).
//
// attn_prep_rows_mrope  grid (ceil((H + Hkv) / 8), T), block 256: attention_tree.cu's attn_prep_rows with a
//                 position a row from positions [T, 3] int32 (temporal, height, width) instead of pos0 + t. Warp w
//                 RMSNorms + RoPEs head 8·blockIdx.x + w of row t; q to q_out [T, H, D], k / v rows to k_dst / v_dst
//                 row dst_row0 + t (the cache rows of a prefill). Frequency f of rotary_dim / 2 rotates by the height
//                 position where f % 3 == 1 and f < 3·section_h, by the width position where f % 3 == 2 and
//                 f < 3·section_w, else by the temporal one (the interleaved layout, mrope.py mrope_tables):
//                 angle = f32(p_axis(f)) · inv_freq[f], then norm_rope_head's cosf / sinf and products.
//                 A row whose three positions are equal (every text token) goes through attention_common.cuh's
//                 norm_rope_head itself, the function attn_prep_rows and decode prep with, so its bits are a text
//                 row's at that position: a prompt's text before its first image keeps a text-only prompt's bits (the
//                 prefix cache shares those rows), and text rows at index + delta get decode's rotation there.
// Layout: qg [T, H, 2D] (q then gate per head); k_new / v_new [T, Hkv, D] float32; KV rows float or kv_bf16.
// History: v1.
#include "common.cuh"
#include "attention_common.cuh"

// norm_rope_head (attention_common.cuh) with the angle of frequency f taken at the position of its axis: the same
// RMSNorm, the same products and sums, operand for operand; only the position each angle multiplies differs.
template <typename KV>
__device__ __forceinline__ void norm_mrope_head(const float* __restrict__ src, const float* __restrict__ w,
                                                const float* __restrict__ inv_freq, int head_dim, int rotary_dim,
                                                int pos_t, int pos_h, int pos_w, int section_h, int section_w,
                                                float eps, float* stage, float* dst, KV* dst2) {
  const int lane = threadIdx.x & 31;
  float x[8];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[i] = 32 * i < head_dim ? src[lane + 32 * i] : 0.0f;
    ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
  }
  ss = warp_sum(ss);
  const float inv = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(ss, (float)head_dim), eps)));
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (32 * i < head_dim) stage[lane + 32 * i] = __fmul_rn(__fmul_rn(x[i], inv), w[lane + 32 * i]);
  __syncwarp();
  const int half = rotary_dim / 2;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane + 32 * i;
    if (d >= head_dim) continue;
    const float nx = stage[d];
    float out = nx;
    if (d < rotary_dim) {
      const int f = d < half ? d : d - half;
      const int pos = (f % 3 == 1 && f < 3 * section_h) ? pos_h : (f % 3 == 2 && f < 3 * section_w) ? pos_w : pos_t;
      const float ang = __fmul_rn((float)pos, inv_freq[f]);
      const float c = cosf(ang), s = sinf(ang);
      out = d < half ? __fsub_rn(__fmul_rn(nx, c), __fmul_rn(stage[d + half], s))
                     : __fadd_rn(__fmul_rn(nx, c), __fmul_rn(stage[d - half], s));
    }
    if (dst != nullptr) dst[d] = kv_round<KV>(out);
    if (dst2 != nullptr) kv_store(dst2 + d, out);
  }
  __syncwarp();  // stage may be reused by the caller
}

// One head of one row: the text function where the row's positions are equal, else the 3-D one.
template <typename KV>
__device__ __forceinline__ void prep_head(const float* src, const float* w, const float* inv_freq, int head_dim,
                                          int rotary_dim, const int* pos3, int section_h, int section_w, float eps,
                                          float* stage, float* dst, KV* dst2) {
  const int pt = pos3[0], ph = pos3[1], pw = pos3[2];
  if (pt == ph && ph == pw) {
    norm_rope_head<KV>(src, w, inv_freq, head_dim, rotary_dim, pt, eps, stage, dst, dst2);
  } else {
    norm_mrope_head<KV>(src, w, inv_freq, head_dim, rotary_dim, pt, ph, pw, section_h, section_w, eps, stage, dst,
                        dst2);
  }
}

template <typename KV>
__device__ __forceinline__ void attn_prep_rows_mrope_impl(
    const float* __restrict__ qg, const float* __restrict__ k_new, const float* __restrict__ v_new,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
    const int* __restrict__ positions, int section_h, int section_w, float* __restrict__ q_out,
    KV* __restrict__ k_dst, KV* __restrict__ v_dst, int num_heads, int num_kv_heads, int head_dim, int rotary_dim,
    int dst_row0, float eps) {
  __shared__ float stage[ATTN_WARPS][256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hb = blockIdx.x * ATTN_WARPS + warp, t = blockIdx.y;
  if (hb >= num_heads + num_kv_heads) return;
  const int* pos3 = positions + 3 * (size_t)t;
  if (hb < num_heads) {
    prep_head<float>(qg + ((size_t)t * num_heads + hb) * 2 * head_dim, q_norm, inv_freq, head_dim, rotary_dim, pos3,
                     section_h, section_w, eps, stage[warp], q_out + ((size_t)t * num_heads + hb) * head_dim, nullptr);
    return;
  }
  const int j = hb - num_heads;
  const size_t row = ((size_t)(dst_row0 + t) * num_kv_heads + j) * head_dim;
  const size_t src = ((size_t)t * num_kv_heads + j) * head_dim;
  prep_head<KV>(k_new + src, k_norm, inv_freq, head_dim, rotary_dim, pos3, section_h, section_w, eps, stage[warp],
                nullptr, k_dst + row);
  for (int d = lane; d < head_dim; d += 32) kv_store(v_dst + row + d, v_new[src + d]);
}
#define ATTN_PREP_ROWS_MROPE_KERNEL(SUF, KV)                                                                      \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prep_rows_mrope##SUF(                           \
      const float* __restrict__ qg, const float* __restrict__ k_new, const float* __restrict__ v_new,             \
      const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float* __restrict__ inv_freq,     \
      const int* __restrict__ positions, int section_h, int section_w, float* __restrict__ q_out,                 \
      KV* __restrict__ k_dst, KV* __restrict__ v_dst, int num_heads, int num_kv_heads, int head_dim,              \
      int rotary_dim, int dst_row0, float eps) {                                                                  \
    PDL_ENTER                                                                                                     \
    attn_prep_rows_mrope_impl<KV>(qg, k_new, v_new, q_norm, k_norm, inv_freq, positions, section_h, section_w,    \
                                  q_out, k_dst, v_dst, num_heads, num_kv_heads, head_dim, rotary_dim, dst_row0,   \
                                  eps);                                                                           \
  }
ATTN_PREP_ROWS_MROPE_KERNEL(, float)
ATTN_PREP_ROWS_MROPE_KERNEL(_bf16, kv_bf16)
