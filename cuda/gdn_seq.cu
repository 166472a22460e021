// gdn_seq.cu: a Gated DeltaNet layer over many tokens after its in_qkv / a / b / z projections: prefill (T tokens
// of one sequence), tree verify (N draft-tree nodes, each from its own path's state) and commit (replay of the
// accepted path onto the entry state). Spec §4; DESIGN.md "Branch, undo, restore". Reference:
// tandem/backend/cuda/gdn_seq.py `reference_prefill` / `reference_tree` / `reference_commit` (numpy_ops composed as
// Qwen3_5Model.gdn_inputs / _gdn and qwen3_5/verify.py `_windows` / `_gdn_tree` / `commit`).
//
// Every token (node) gets the arithmetic of gdn_step.cu, operation for operation, so a prefill equals T decode
// steps and a verified node equals a decode of its path, bit for bit (same roundings, same reduction trees: the
// L2 and RMS norms reduce with block_sum over blockDim = dv threads as gdn_step does).
//
// gdn_seq_prep    grid (N, Hk), block dv: node n, k-head kh. Causal conv + SiLU of its channels (q, k of kh and the
//   v channels of kh's v-heads) from the node's window: K-1 path rows (ancestors via parent_ids, or n-1, n-2, ...
//   when parent_ids is null, then the conv tail from its last row up), then its own row; L2 norms (q · dk^-1/2);
//   gates g = -exp(A_log) · softplus(a + dt_bias), beta = σ(b) of kh's v-heads. Writes q, k [N, Hk, dk],
//   v [N, Hv, dv], g, beta [N, Hv]. The tail is only read.
// gdn_seq_scan<DK> grid (Hv, dv / COLS), block 32, DK ∈ {64, 128}: PARTS = DK / 64 lanes a state column (COLS =
//   32 / PARTS columns a block), each holding 64 of its rows in registers; the lanes of a column take turns along
//   the dot products, shuffling the running sum on, so p and o are gdn_step's single fma chains over i = 0..DK-1.
//   Visits nodes order[0..num_visits) (null: 0, 1, ...): S = S · exp(g); p = Sᵀk; S += k ⊗ beta (v - p); o = Sᵀq.
//   Tree: stack[0][vi] ≥ 0 restores the registers from that shared-memory slot before the visit (the parent's
//   state), stack[1][vi] ≥ 0 saves them after it (the node has ≥ 2 children). Each thread reads / writes only its
//   own part of a slot, so the stack needs no barrier. q null: no output (commit). write_state: registers go
//   back to `state` at the end (prefill, commit; never in verify). num_rows > 0: the conv tail becomes the last
//   K-1 rows of [tail; mixed[order[0..num_rows)]] (grid-stride over channels, one thread a channel).
// gdn_seq_norm    grid N·Hv, block dv: y = norm_w · o · rsqrt(mean(o²) + eps) · silu(z), in place over o.
// Shared memory: prep 2·dk floats; scan 4·DK floats (double-buffered k, q) + num_slots · 64 · 32 floats (8 KiB a
//   slot: one saved state tile of the block); norm none (block_sum's 32-float scratch).
// History: v1 prep / scan / norm; tree stack of saved state tiles, pushed only at branching nodes; a column split
//   over DK / 64 lanes (one lane a column spilled 576 bytes at DK = 128).
#include "common.cuh"

#define SCAN_THREADS 32
#define SCAN_ROWS 64  // state rows a scan thread holds in registers
#define MAX_TAPS 8

// Conv window row of node x: x ≥ 0 a row of `mixed`, x < 0 row K-1+x of the tail (-1 its last row).
__device__ __forceinline__ int window_step(const int* __restrict__ parent_ids, int x) {
  return x >= 0 && parent_ids ? parent_ids[x] : x - 1;
}

extern "C" __global__ void __launch_bounds__(1024)
gdn_seq_prep(const float* __restrict__ mixed, const float* __restrict__ tail, const float* __restrict__ conv_w,
             const int* __restrict__ parent_ids, const float* __restrict__ a, const float* __restrict__ b,
             const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ q_out,
             float* __restrict__ k_out, float* __restrict__ v_out, float* __restrict__ g_out,
             float* __restrict__ beta_out, int channels, int taps, int num_k_heads, int num_v_heads, int dk, int dv,
             float q_scale) {
  extern __shared__ float prep_smem[];  // uq[dk], uk[dk]: conv outputs of this k-head's q, k channels
  __shared__ float scratch[32];
  float* uq = prep_smem;
  float* uk = prep_smem + dk;
  const int n = blockIdx.x, kh = blockIdx.y, col = threadIdx.x;
  const int r = num_v_heads / num_k_heads;

  int back[MAX_TAPS];  // back[j]: the row j steps before node n (back[0] = n), see window_step
  back[0] = n;
#pragma unroll
  for (int j = 1; j < MAX_TAPS; ++j) back[j] = j < taps ? window_step(parent_ids, back[j - 1]) : 0;
  auto conv_silu = [&](int c) {  // gdn_conv_step's arithmetic: taps in order, products and sums rounded
    const float* w = conv_w + (size_t)c * taps;
    float acc = 0.0f;
#pragma unroll
    for (int j = MAX_TAPS - 1; j >= 0; --j) {
      if (j < taps) {
        const int x = back[j];
        const float xj = x >= 0 ? mixed[(size_t)x * channels + c] : tail[(size_t)(taps - 1 + x) * channels + c];
        const float prod = __fmul_rn(xj, w[taps - 1 - j]);
        acc = j == taps - 1 ? prod : __fadd_rn(acc, prod);
      }
    }
    return __fdiv_rn(acc, __fadd_rn(1.0f, expf(-acc)));
  };

  float sq = 0.0f, sk = 0.0f;
  for (int i = col; i < dk; i += blockDim.x) {
    uq[i] = conv_silu(kh * dk + i);
    uk[i] = conv_silu((num_k_heads + kh) * dk + i);
    sq = fmaf(uq[i], uq[i], sq);
    sk = fmaf(uk[i], uk[i], sk);
  }
  const float inv_q = 1.0f / sqrtf(block_sum(sq, scratch) + 1e-6f);
  const float inv_k = 1.0f / sqrtf(block_sum(sk, scratch) + 1e-6f);
  const size_t qk = ((size_t)n * num_k_heads + kh) * dk;
  for (int i = col; i < dk; i += blockDim.x) {
    q_out[qk + i] = __fmul_rn(__fmul_rn(uq[i], inv_q), q_scale);
    k_out[qk + i] = __fmul_rn(uk[i], inv_k);
  }
  const int v0 = 2 * num_k_heads * dk + kh * r * dv;  // first v channel of kh's v-heads
  for (int j = col; j < r * dv; j += blockDim.x)
    v_out[((size_t)n * num_v_heads + kh * r) * dv + j] = conv_silu(v0 + j);
  for (int j = col; j < r; j += blockDim.x) {
    const int h = kh * r + j;
    const size_t nh = (size_t)n * num_v_heads + h;
    const float x = __fadd_rn(a[nh], dt_bias[h]);
    const float softplus = x > 20.0f ? x : log1pf(expf(x));
    g_out[nh] = __fmul_rn(-expf(a_log[h]), softplus);
    beta_out[nh] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-b[nh])));
  }
}

// New conv tail: the last K-1 rows of [tail; mixed[order[0..num_rows)]], one thread a channel, rows ascending (row i
// reads row num_rows + i > i of the old tail before anyone overwrites it).
__device__ __forceinline__ void shift_tail(float* __restrict__ tail, const float* __restrict__ mixed,
                                           const int* __restrict__ order, int num_rows, int channels, int taps) {
  const int first = (blockIdx.x * gridDim.y + blockIdx.y) * blockDim.x + threadIdx.x;
  const int stride = gridDim.x * gridDim.y * blockDim.x;
  for (int c = first; c < channels; c += stride) {
    for (int i = 0; i + 1 < taps; ++i) {
      const int hist = num_rows + i;
      float x;
      if (hist < taps - 1) {
        x = tail[(size_t)hist * channels + c];
      } else {
        const int row = hist - (taps - 1);
        x = mixed[(size_t)(order ? order[row] : row) * channels + c];
      }
      tail[(size_t)i * channels + c] = x;
    }
  }
}

template <int DK>
__device__ __forceinline__ void gdn_scan(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ order,
    const int* __restrict__ stack, int num_visits, float* __restrict__ state, int write_state,
    float* __restrict__ o, float* __restrict__ tail, const float* __restrict__ mixed, int num_rows, int channels,
    int taps, int num_k_heads, int num_v_heads, int dv) {
  // A column's DK rows are split in PARTS runs of SCAN_ROWS, one lane each; the lanes of a column take turns along
  // the dot products (shuffling the running sum on), so p and o are the same single fma chains as gdn_step's.
  constexpr int PARTS = DK / SCAN_ROWS, COLS = SCAN_THREADS / PARTS, PER = DK / SCAN_THREADS;
  extern __shared__ float scan_smem[];  // qk[2][2·DK] (k then q, double-buffered), slots[num_slots][64][32]
  float* slots = scan_smem + 4 * DK;
  const int h = blockIdx.x, tid = threadIdx.x, part = tid / COLS, lane_col = tid % COLS;
  const int col = blockIdx.y * COLS + lane_col, row0 = part * SCAN_ROWS;
  const int kh = h / (num_v_heads / num_k_heads);
  if (num_rows > 0) shift_tail(tail, mixed, order, num_rows, channels, taps);

  float s[SCAN_ROWS];  // rows row0 .. row0 + 63 of this thread's state column
  float* s_col = state + ((size_t)h * DK + row0) * dv + col;
#pragma unroll
  for (int i = 0; i < SCAN_ROWS; ++i) s[i] = s_col[(size_t)i * dv];

  // Next visit's inputs, fetched one visit ahead so the loads overlap the current visit's arithmetic.
  float kn[PER], qn[PER], vn = 0.0f, gn = 0.0f, bn = 0.0f;
  int restore_n = -1, save_n = -1;
  auto fetch = [&](int vi) {
    const int n = order ? order[vi] : vi;
    const size_t qk = ((size_t)n * num_k_heads + kh) * DK + tid;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      kn[j] = k[qk + j * SCAN_THREADS];
      qn[j] = q ? q[qk + j * SCAN_THREADS] : 0.0f;
    }
    const size_t nh = (size_t)n * num_v_heads + h;
    vn = v[nh * dv + col];
    gn = g[nh];
    bn = beta[nh];
    restore_n = stack ? stack[vi] : -1;
    save_n = stack ? stack[num_visits + vi] : -1;
    return n;
  };
  int n_next = fetch(0);

  for (int vi = 0; vi < num_visits; ++vi) {
    float* ks = scan_smem + (vi & 1) * 2 * DK;
    float* qs = ks + DK;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      ks[tid + j * SCAN_THREADS] = kn[j];
      qs[tid + j * SCAN_THREADS] = qn[j];
    }
    const int n = n_next, restore = restore_n, save = save_n;
    const float vv = vn, gg = gn, bb = bn;
    __syncthreads();  // a buffer is rewritten two visits later, after every thread passed this barrier once more
    if (vi + 1 < num_visits) n_next = fetch(vi + 1);

    if (restore >= 0) {
      const float* slot = slots + (size_t)restore * SCAN_ROWS * SCAN_THREADS + tid;
#pragma unroll
      for (int i = 0; i < SCAN_ROWS; ++i) s[i] = slot[i * SCAN_THREADS];
    }
    const float decay = expf(gg);
#pragma unroll
    for (int i = 0; i < SCAN_ROWS; ++i) s[i] = __fmul_rn(s[i], decay);
    float p = 0.0f;
#pragma unroll
    for (int j = 0; j < PARTS; ++j) {
      if (part == j) {
#pragma unroll
        for (int i = 0; i < SCAN_ROWS; ++i) p = fmaf(s[i], ks[row0 + i], p);
      }
      if (PARTS > 1) p = __shfl_sync(0xFFFFFFFFu, p, j * COLS + lane_col);
    }
    const float delta = __fmul_rn(bb, __fsub_rn(vv, p));
#pragma unroll
    for (int i = 0; i < SCAN_ROWS; ++i) s[i] = __fadd_rn(s[i], __fmul_rn(ks[row0 + i], delta));
    if (q) {
      float out = 0.0f;
#pragma unroll
      for (int j = 0; j < PARTS; ++j) {
        if (part == j) {
#pragma unroll
          for (int i = 0; i < SCAN_ROWS; ++i) out = fmaf(s[i], qs[row0 + i], out);
        }
        if (PARTS > 1) out = __shfl_sync(0xFFFFFFFFu, out, j * COLS + lane_col);
      }
      if (part == PARTS - 1) o[((size_t)n * num_v_heads + h) * dv + col] = out;
    }
    if (save >= 0) {
      float* slot = slots + (size_t)save * SCAN_ROWS * SCAN_THREADS + tid;
#pragma unroll
      for (int i = 0; i < SCAN_ROWS; ++i) slot[i * SCAN_THREADS] = s[i];
    }
  }
  if (write_state) {
#pragma unroll
    for (int i = 0; i < SCAN_ROWS; ++i) s_col[(size_t)i * dv] = s[i];
  }
}

#define GDN_SCAN_ARGS                                                                                          \
  const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,                       \
      const float *__restrict__ g, const float *__restrict__ beta, const int *__restrict__ order,              \
      const int *__restrict__ stack, int num_visits, float *__restrict__ state, int write_state,               \
      float *__restrict__ o, float *__restrict__ tail, const float *__restrict__ mixed, int num_rows,          \
      int channels, int taps, int num_k_heads, int num_v_heads, int dv
#define GDN_SCAN_PASS \
  q, k, v, g, beta, order, stack, num_visits, state, write_state, o, tail, mixed, num_rows, channels, taps, \
      num_k_heads, num_v_heads, dv

extern "C" __global__ void __launch_bounds__(SCAN_THREADS) gdn_seq_scan64(GDN_SCAN_ARGS) {
  gdn_scan<64>(GDN_SCAN_PASS);
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS) gdn_seq_scan128(GDN_SCAN_ARGS) {
  gdn_scan<128>(GDN_SCAN_PASS);
}

extern "C" __global__ void __launch_bounds__(1024)
gdn_seq_norm(float* __restrict__ y, const float* __restrict__ z, const float* __restrict__ norm_w, int dv,
             float eps) {
  __shared__ float scratch[32];
  const size_t idx = (size_t)blockIdx.x * dv + threadIdx.x;
  const float o = y[idx];
  const float inv = 1.0f / sqrtf(block_sum(__fmul_rn(o, o), scratch) / (float)dv + eps);
  const float zz = z[idx];
  const float gate = __fdiv_rn(zz, __fadd_rn(1.0f, expf(-zz)));
  y[idx] = __fmul_rn(__fmul_rn(norm_w[threadIdx.x], __fmul_rn(o, inv)), gate);
}
