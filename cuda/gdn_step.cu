// gdn_step.cu: one decode token of a Gated DeltaNet layer after its in_qkv / a / b / z projections
// (spec §4; reference: tandem/backend/cuda/gdn_step.py `reference`, built from numpy_ops.causal_conv,
// l2norm, gdn_gates, gdn_step and gated_rms_norm exactly as Qwen3_5Model.gdn_inputs / _gdn compose them).
//
// The conv before it (u[c] = silu(Σ_j w[c, j] · window[j, c]), window = [tail rows 0..K-2, mixed], then the tail
// shifted up a row) is gdn_seq.cu's gdn_decode_conv, which the launcher runs first.
// gdn_step       grid Hv, block dv (a multiple of 32), thread = state column v of head h:
//   q, k = l2norm (q · dk^-1/2) of k-head h / (Hv / Hk); g = -exp(A_log) · softplus(a + dt_bias),
//   beta = σ(b); S = S · exp(g); p = Sᵀk; S += k ⊗ beta (v - p); o = Sᵀq; y = gated_rms_norm(o, z). The dot
//   products in common.cuh's GDN_RUN order.
//   The state column is read twice (p first, then the update) instead of held in registers.
// Layout: mixed, u [C = 2·Hk·dk + Hv·dv] (q | k | v); tail [K-1, C]; conv_w [C, K]; a, b, A_log, dt_bias
// [Hv]; z, y [Hv·dv]; norm_w [dv]; state [Hv, dk, dv] fp32, written in place.
// History: v1 two kernels, block per v-head; v1.1 the conv kernel is gdn_seq.cu's (one copy of its arithmetic);
// v1.2 p and o as 32-row fma chains and a pairwise tree (common.cuh GDN_RUN), gdn_seq.cu's order.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024)
gdn_step(const float* __restrict__ u, const float* __restrict__ a, const float* __restrict__ b,
         const float* __restrict__ a_log, const float* __restrict__ dt_bias, const float* __restrict__ z,
         const float* __restrict__ norm_w, float* __restrict__ state, float* __restrict__ y,
         int num_k_heads, int num_v_heads, int dk, int dv, float q_scale, float eps) {
  PDL_ENTER
  extern __shared__ float smem[];  // qs[dk], ks[dk]
  __shared__ float scratch[32];
  float* qs = smem;
  float* ks = smem + dk;
  const int h = blockIdx.x, col = threadIdx.x;
  const int kh = h / (num_v_heads / num_k_heads);
  const float* q_raw = u + (size_t)kh * dk;
  const float* k_raw = u + (size_t)(num_k_heads + kh) * dk;
  const float* v_raw = u + (size_t)2 * num_k_heads * dk + (size_t)h * dv;

  float sq = 0.0f, sk = 0.0f;
  for (int i = col; i < dk; i += blockDim.x) {
    sq = fmaf(q_raw[i], q_raw[i], sq);
    sk = fmaf(k_raw[i], k_raw[i], sk);
  }
  const float inv_q = 1.0f / sqrtf(block_sum(sq, scratch) + 1e-6f);
  const float inv_k = 1.0f / sqrtf(block_sum(sk, scratch) + 1e-6f);
  for (int i = col; i < dk; i += blockDim.x) {
    qs[i] = __fmul_rn(__fmul_rn(q_raw[i], inv_q), q_scale);
    ks[i] = __fmul_rn(k_raw[i], inv_k);
  }
  __syncthreads();

  const float x = __fadd_rn(a[h], dt_bias[h]);
  const float softplus = x > 20.0f ? x : log1pf(expf(x));
  const float g = __fmul_rn(-expf(a_log[h]), softplus);
  const float decay = expf(g);
  const float beta = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-b[h])));

  // p = (S · decay)ᵀk and o = S'ᵀq in common.cuh's order: fma chains over GDN_RUN-row runs, a pairwise tree over
  // the runs (the bits of gdn_seq.cu's scan lanes).
  float* s_col = state + (size_t)h * dk * dv + col;
  GdnRunTree pt;
  for (int r0 = 0; r0 < dk; r0 += GDN_RUN) {
    float c = 0.0f;
    for (int i = r0; i < min(r0 + GDN_RUN, dk); ++i) c = fmaf(__fmul_rn(s_col[(size_t)i * dv], decay), ks[i], c);
    pt.push(c);
  }
  const float p = pt.total();
  const float delta = __fmul_rn(beta, __fsub_rn(v_raw[col], p));
  GdnRunTree ot;
  for (int r0 = 0; r0 < dk; r0 += GDN_RUN) {
    float c = 0.0f;
    for (int i = r0; i < min(r0 + GDN_RUN, dk); ++i) {
      const float s = __fadd_rn(__fmul_rn(s_col[(size_t)i * dv], decay), __fmul_rn(ks[i], delta));
      s_col[(size_t)i * dv] = s;
      c = fmaf(s, qs[i], c);
    }
    ot.push(c);
  }
  const float o = ot.total();

  const float inv = 1.0f / sqrtf(block_sum(__fmul_rn(o, o), scratch) / (float)dv + eps);
  const float zz = z[(size_t)h * dv + col];
  const float gate = __fdiv_rn(zz, __fadd_rn(1.0f, expf(-zz)));
  y[(size_t)h * dv + col] = __fmul_rn(__fmul_rn(norm_w[col], __fmul_rn(o, inv)), gate);
}
