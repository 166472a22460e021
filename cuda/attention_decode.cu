// attention_decode.cu: one decode position of a gated full-attention layer after its q / k / v projections
// (spec §5; reference: tandem/backend/cuda/attention_decode.py `reference`, built from numpy_ops.rms_norm,
// rope_tables, apply_rope, attention_decode and sigmoid as Qwen3_5Model.attention_qkv / _attention compose them).
//
// attn_prep     grid H + Hkv, block D: per head RMSNorm (q_norm / k_norm), partial RoPE (first rd channels,
//               half rotation, angle = f32(pos) · inv_freq[i]); q heads to q_out, k / v rows into the caches
//               at row `pos`.
// attn_partial  grid (Hkv, ceil(S / 256)), block 256: one chunk of 256 key rows at absolute positions
//               [256c, 256c + 256) for the G = H / Hkv query heads of KV head j: scores · D^-1/2, chunk max m,
//               l = Σ exp(s - m), acc = Σ exp(s - m) · v. Chunks are fixed by absolute position (DESIGN.md:
//               a tree node must see the blocking a decode at its position sees).
// attn_combine  grid H, block D: out = Σ_c e^(m_c - M) acc_c / Σ_c e^(m_c - M) l_c, chunks in order; then
//               optionally · σ(gate) (the output gate).
// Layout: qg [H, 2D] (q then gate per head), k_new / v_new [Hkv, D], q_out [H, D]; caches [max_len, Hkv, D];
// partials: acc [C, H, D], m / l [C, H]; fp32 throughout. D ≤ 256 and a multiple of 32; G ≤ 8.
// History: v1 split-K by absolute 256-row chunks.
#include "common.cuh"

#define ATTN_CHUNK 256
#define ATTN_MAX_G 8
#define ATTN_THREADS 256

extern "C" __global__ void __launch_bounds__(1024)
attn_prep(const float* __restrict__ qg, const float* __restrict__ k_new, const float* __restrict__ v_new,
          const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
          float* __restrict__ q_out, float* __restrict__ k_cache, float* __restrict__ v_cache, int num_heads,
          int num_kv_heads, int head_dim, int rotary_dim, int pos, float eps) {
  __shared__ float scratch[32];
  __shared__ float normed[1024];
  const int hb = blockIdx.x, d = threadIdx.x;
  const float* src;
  const float* w;
  float* dst;
  if (hb < num_heads) {
    src = qg + (size_t)hb * 2 * head_dim;
    w = q_norm;
    dst = q_out + (size_t)hb * head_dim;
  } else {
    const int j = hb - num_heads;
    const size_t row = ((size_t)pos * num_kv_heads + j) * head_dim;
    src = k_new + (size_t)j * head_dim;
    w = k_norm;
    dst = k_cache + row;
    v_cache[row + d] = v_new[(size_t)j * head_dim + d];
  }
  const float x = src[d];
  const float inv = 1.0f / sqrtf(block_sum(__fmul_rn(x, x), scratch) / (float)head_dim + eps);
  const float nx = __fmul_rn(__fmul_rn(x, inv), w[d]);
  normed[d] = nx;
  __syncthreads();
  const int half = rotary_dim / 2;
  float out = nx;
  if (d < rotary_dim) {
    const int i = d < half ? d : d - half;
    const float ang = __fmul_rn((float)pos, inv_freq[i]);
    const float c = cosf(ang), s = sinf(ang);
    out = d < half ? __fsub_rn(__fmul_rn(nx, c), __fmul_rn(normed[d + half], s))
                   : __fadd_rn(__fmul_rn(nx, c), __fmul_rn(normed[d - half], s));
  }
  dst[d] = out;
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attn_partial(const float* __restrict__ q, const float* __restrict__ keys, const float* __restrict__ values,
             float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l,
             int num_heads, int num_kv_heads, int head_dim, int num_rows, float scale) {
  __shared__ float qs[ATTN_MAX_G * 256];
  __shared__ float sc[ATTN_MAX_G][ATTN_CHUNK];
  const int j = blockIdx.x, c = blockIdx.y;
  const int group = num_heads / num_kv_heads;
  const int p0 = c * ATTN_CHUNK;
  const int n = min(ATTN_CHUNK, num_rows - p0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) qs[i] = q[(size_t)j * group * head_dim + i];
  __syncthreads();

  const int d4 = head_dim / 4;
  for (int p = warp; p < n; p += ATTN_THREADS / 32) {
    const float4* krow = reinterpret_cast<const float4*>(keys + ((size_t)(p0 + p) * num_kv_heads + j) * head_dim);
    float dots[ATTN_MAX_G];
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; ++g) dots[g] = 0.0f;
    for (int e = lane; e < d4; e += 32) {
      const float4 kk = krow[e];
#pragma unroll
      for (int g = 0; g < ATTN_MAX_G; ++g) {
        if (g < group) {
          const float* qq = qs + g * head_dim + 4 * e;
          dots[g] = fmaf(kk.x, qq[0], dots[g]);
          dots[g] = fmaf(kk.y, qq[1], dots[g]);
          dots[g] = fmaf(kk.z, qq[2], dots[g]);
          dots[g] = fmaf(kk.w, qq[3], dots[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; ++g) {
      if (g < group) {
        const float t = warp_sum(dots[g]);
        if (lane == 0) sc[g][p] = __fmul_rn(t, scale);
      }
    }
  }
  __syncthreads();

  if (warp < group) {
    float m = TANDEM_NEG_INF;
    for (int p = lane; p < n; p += 32) m = fmaxf(m, sc[warp][p]);
    m = warp_max(m);
    float l = 0.0f;
    for (int p = lane; p < n; p += 32) {
      const float e = expf(__fsub_rn(sc[warp][p], m));
      sc[warp][p] = e;
      l = __fadd_rn(l, e);
    }
    l = warp_sum(l);
    if (lane == 0) {
      part_m[(size_t)c * num_heads + j * group + warp] = m;
      part_l[(size_t)c * num_heads + j * group + warp] = l;
    }
  }
  __syncthreads();

  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc[ATTN_MAX_G];
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; ++g) acc[g] = 0.0f;
    const float* vcol = values + (size_t)p0 * num_kv_heads * head_dim + (size_t)j * head_dim + d;
    for (int p = 0; p < n; ++p) {
      const float vv = vcol[(size_t)p * num_kv_heads * head_dim];
#pragma unroll
      for (int g = 0; g < ATTN_MAX_G; ++g)
        if (g < group) acc[g] = fmaf(sc[g][p], vv, acc[g]);
    }
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; ++g)
      if (g < group) part_acc[((size_t)c * num_heads + j * group + g) * head_dim + d] = acc[g];
  }
}

extern "C" __global__ void __launch_bounds__(1024)
attn_combine(const float* __restrict__ part_acc, const float* __restrict__ part_m, const float* __restrict__ part_l,
             const float* __restrict__ gate, int has_gate, int gate_stride, float* __restrict__ out, int num_heads, int head_dim,
             int num_chunks) {
  const int h = blockIdx.x, d = threadIdx.x;
  float big = TANDEM_NEG_INF;
  for (int c = 0; c < num_chunks; ++c) big = fmaxf(big, part_m[(size_t)c * num_heads + h]);
  float num = 0.0f, den = 0.0f;
  for (int c = 0; c < num_chunks; ++c) {
    const float w = expf(__fsub_rn(part_m[(size_t)c * num_heads + h], big));
    den = fmaf(w, part_l[(size_t)c * num_heads + h], den);
    num = fmaf(w, part_acc[((size_t)c * num_heads + h) * head_dim + d], num);
  }
  float o = __fdiv_rn(num, den);
  if (has_gate) {
    const float gz = gate[(size_t)h * gate_stride + d];
    o = __fmul_rn(o, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gz))));
  }
  out[(size_t)h * head_dim + d] = o;
}
