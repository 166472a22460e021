// gdn_seq.cu: a Gated DeltaNet layer after its in_qkv / a / b / z projections: prefill (T tokens of one sequence),
// decode (one token, the prefill's bits in two launches), tree verify (N draft-tree nodes, each from its own path's
// state) and commit (replay of the accepted path onto the entry state). Spec §4; DESIGN.md "Branch, undo, restore".
// Reference: tandem/backend/cuda/gdn_seq.py `reference_prefill` (decode: T = 1) / `reference_tree` /
// `reference_commit` (numpy_ops composed as Qwen3_5Model.gdn_inputs / _gdn and qwen3_5/verify.py `_windows` /
// `_gdn_tree` / `commit`).
//
// Every token (node) gets the arithmetic of gdn_step.cu, operation for operation, so a prefill equals T decode
// steps and a verified node equals a decode of its path, bit for bit (same roundings, same reduction trees: the
// L2 and RMS norms reduce with block_sum over blockDim = dv threads as gdn_step does).
//
// gdn_seq_prep4/8 grid (N, Hk), block dv: node n, k-head kh. Causal conv + SiLU of its channels (q, k of kh and the
//   v channels of kh's v-heads) from the node's window: K-1 path rows (ancestors via parent_ids, or n-1, n-2, ...
//   when parent_ids is null, then the conv tail from its last row up), then its own row; L2 norms (q · dk^-1/2);
//   gates g = -exp(A_log) · softplus(a + dt_bias), beta = σ(b) of kh's v-heads. Writes q, k [N, Hk, dk],
//   v [N, Hv, dv], g, beta [N, Hv]. The tail is only read.
// gdn_seq_scan<DK> grid (Hv, dv / (W · COLS)), block W warps (W ≤ SCAN_MAX_WARPS = 4, gdn_seq.py picks the most
//   that divide dv / COLS), DK ∈ {32, 64, 128, 256}: PARTS = DK / ROWS lanes a state column (COLS = 32 / PARTS
//   columns a warp), each holding ROWS = min(DK, 64) of its rows in registers (ScanShape); p and o are common.cuh's
//   GDN_RUN order (one or two 32-row chains a lane, the lanes' sums added by xor shuffles: gdn_step's bits).
//   Visits nodes order[0..num_visits) (null: 0, 1, ...): S = S · exp(g); p = Sᵀk; S += k ⊗ beta (v - p); o = Sᵀq.
//   A visit's inputs (k, q, v, g, beta, its stack entries) come through a shared-memory ring filled by cp.async
//   SCAN_RING - 1 visits ahead; the entry state is read before pdl_wait.
//   Tree: stack[0][vi] ≥ 0 restores the registers from that shared-memory slot before the visit (the parent's
//   state), stack[1][vi] ≥ 0 saves them after it (the node has ≥ 2 children). Each thread reads / writes only its
//   own part of a slot (a slot holds one tile a warp), so the stack needs no barrier. q null: no output (commit).
//   write_state: registers go back to `state` at the end (prefill, commit; never in verify). num_rows > 0: the
//   conv tail becomes the last K-1 rows of [tail; mixed[order[0..num_rows)]] (grid-stride over channels, one thread
//   a channel).
// gdn_seq_norm    grid N·Hv, block dv: y = norm_w · o · rsqrt(mean(o²) + eps) · silu(z), in place over o; kind > 0
//   (common.cuh SPLIT_*): writes the out projection's operand xs [N, P, Hv·dv] with store_split instead of y (the
//   bits of gemv_prep on y).
// Decode (one token, T = 1; the bits of prep + scan + norm at N = 1, in two launches):
// gdn_decode_conv grid ceil(C / 256), block 256, thread = channel: u = prep's conv_silu of [tail rows; mixed], then
//   the thread's tail column shifts up a row in place.
// gdn_decode_head<DK> grid Hv, block min(dv / COLS, 8) warps (COLS as the scan: 32 columns a warp at DK ≤ 64, 16 at
//   128, 8 at 256), one block a v-head: L2 norms of its k-head's q, k from u and its gates; each warp takes column groups
//   w, w + warps, ... and runs one scan visit per column with the scan's lane layout (state in registers, read
//   and written back); then the gated RMSNorm of the head's dv outputs (shared memory) into y or xs. The two
//   block reductions replay block_sum over blockDim = dv (prep's and norm's launch) whatever this block's shape.
// Layout: mixed, u [N, C] (q | k | v, C = 2·Hk·dk + Hv·dv); tail [K-1, C]; conv_w [C, K]; a, b, g, beta [N, Hv];
//   q, k [N, Hk, dk]; v [N, Hv, dv]; z, y [N, Hv·dv]; xs [N, P, Hv·dv] u16 (P = 2 fp16, 3 bf16); norm_w [dv];
//   state [Hv, dk, dv] fp32. All C-contiguous float32 unless said.
// Shared memory: prep 2·dk floats; scan SCAN_RING · (2·DK + 4·COLS + 8) floats (the input ring, ScanRing) +
//   num_slots · W · ROWS · 32 floats (8 KiB a warp and slot at DK ≥ 64, 4 KiB at 32: one saved state tile); norm none (block_sum's 32-float
//   scratch); decode head 4·DK + 1024 + 96 floats, static.
// History: v1 prep / scan / norm; tree stack of saved state tiles, pushed only at branching nodes; a column split
//   over DK / 64 lanes (one lane a column spilled 576 bytes at DK = 128); v2 decode in two launches
//   (gdn_decode_conv, gdn_decode_head<DK>) and the norm's split output (no gemv_prep launch before out_proj); v2.1
//   gdn_decode_head loads its first state columns before pdl_wait; p and o as 32-row chains and a tree (GDN_RUN);
//   v2.2 gdn_decode_head issues all its reads of the previous kernel's outputs (q, k, gates, z, v) at once; v2.3 the
//   scan in blocks of 4 warps (was 1), its inputs through a cp.async ring 3 visits ahead shared by the warps (was:
//   the next visit's, in registers), its entry state read before pdl_wait (what bounds a visit is one warp's ~560
//   dependent instructions, ~3.1 cycles each: Nsight Compute);
//   v2.4 gdn_seq_prep walks a node's ancestors before pdl_wait and loads a conv window's taps together (each tap's
//   load had waited on the one before: ~20 dependent L2 round trips a thread at 27B, now 5), in two instances by the
//   window's register count (gdn_seq_prep4, gdn_seq_prep8); v2.5 key head sizes 32 (a lane holds one 32-row run)
//   and 256 (four lanes a column) next to 64 and 128 (ScanShape); v2.6 several slots' decode tokens in one launch each
//   (gdn_decode_conv_slots, gdn_decode_head_slots<DK>: the same conv_silu_shift / gdn_decode_head<DK>, its v-head an
//   argument, with each slot's tail and state from a table of addresses).
#include "common.cuh"

#define SCAN_THREADS 32
#define SCAN_ROWS 64  // most state rows a scan thread holds in registers (ScanShape<DK>::ROWS = min(DK, 64))
#define MAX_TAPS 8
#define DECODE_MAX_WARPS 8  // most warps a gdn_decode_head block has
#define DECODE_MAX_DV 1024

// The gates of one token and v-head (gdn_step's formulas): g = -exp(A_log) · softplus(a + dt_bias), beta = σ(b).
__device__ __forceinline__ float gate_g(float a, float dt_bias, float a_log) {
  const float x = __fadd_rn(a, dt_bias);
  const float softplus = x > 20.0f ? x : log1pf(expf(x));
  return __fmul_rn(-expf(a_log), softplus);
}

__device__ __forceinline__ float gate_beta(float b) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-b))); }

// Conv window row of node x: x ≥ 0 a row of `mixed`, x < 0 row K-1+x of the tail (-1 its last row). parent_ids is read
// through L2: gdn_seq_prep walks it before pdl_wait.
__device__ __forceinline__ int window_step(const int* __restrict__ parent_ids, int x) {
  return x >= 0 && parent_ids ? __ldcg(parent_ids + x) : x - 1;
}

#define GDN_PREP_PARAMS                                                                                         \
  const float *__restrict__ mixed, const float *__restrict__ tail, const float *__restrict__ conv_w,              \
      const int *__restrict__ parent_ids, const float *__restrict__ a, const float *__restrict__ b,               \
      const float *__restrict__ a_log, const float *__restrict__ dt_bias, float *__restrict__ q_out,              \
      float *__restrict__ k_out, float *__restrict__ v_out, float *__restrict__ g_out, float *__restrict__ beta_out, \
      int channels, int taps, int num_k_heads, int num_v_heads, int dk, int dv, float q_scale
#define GDN_PREP_PASS                                                                                          \
  mixed, tail, conv_w, parent_ids, a, b, a_log, dt_bias, q_out, k_out, v_out, g_out, beta_out, channels, taps, \
      num_k_heads, num_v_heads, dk, dv, q_scale

// KMAX: the most taps the instance takes (its window registers; taps ≤ KMAX): gdn_seq_prep4 for Qwen3.5's 4 taps, with
// a window's loads in flight together in 8 registers; gdn_seq_prep8 any K ≤ MAX_TAPS (its 16 window registers spill
// under the 1024-thread bound, still correct).
template <int KMAX>
__device__ __forceinline__ void gdn_seq_prep(GDN_PREP_PARAMS) {
  extern __shared__ float prep_smem[];  // uq[dk], uk[dk]: conv outputs of this k-head's q, k channels
  __shared__ float scratch[32];
  float* uq = prep_smem;
  float* uk = prep_smem + dk;
  const int n = blockIdx.x, kh = blockIdx.y, col = threadIdx.x;
  const int r = num_v_heads / num_k_heads;

  // The window's ancestor walk (K-1 dependent reads) before pdl_wait (common.cuh PDL rule 2): parent_ids is the
  // host's table, copied before the verify's launches, never written by a kernel.
  int back[KMAX];  // back[j]: the row j steps before node n (back[0] = n), see window_step
  back[0] = n;
#pragma unroll
  for (int j = 1; j < KMAX; ++j) back[j] = j < taps ? window_step(parent_ids, back[j - 1]) : 0;
  PDL_ENTER
  // A conv window: its taps' inputs and weights, every load issued before any is used (a tap a round trip before).
  struct Window {
    float x[KMAX], w[KMAX];
  };
  auto load_window = [&](int c, Window& win) {
    const float* w = conv_w + (size_t)c * taps;
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
      if (j < taps) {
        const int x = back[j];
        win.x[j] = x >= 0 ? mixed[(size_t)x * channels + c] : tail[(size_t)(taps - 1 + x) * channels + c];
        win.w[j] = w[taps - 1 - j];
      }
    }
  };
  auto conv_silu = [&](const Window& win) {  // gdn_conv_step's arithmetic: taps in order, products and sums rounded
    float acc = 0.0f;
#pragma unroll
    for (int j = KMAX - 1; j >= 0; --j) {
      if (j < taps) {
        const float prod = __fmul_rn(win.x[j], win.w[j]);
        acc = j == taps - 1 ? prod : __fadd_rn(acc, prod);
      }
    }
    return __fdiv_rn(acc, __fadd_rn(1.0f, expf(-acc)));
  };
  float a0 = 0.0f, b0 = 0.0f;  // the gates' inputs of v-head kh · r + col, read with the windows
  if (col < r) {
    const size_t nh = (size_t)n * num_v_heads + kh * r + col;
    a0 = a[nh];
    b0 = b[nh];
  }

  float sq = 0.0f, sk = 0.0f;
  for (int i = col; i < dk; i += blockDim.x) {
    Window win;
    load_window(kh * dk + i, win);
    uq[i] = conv_silu(win);
    load_window((num_k_heads + kh) * dk + i, win);
    uk[i] = conv_silu(win);
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
  float* vo = v_out + ((size_t)n * num_v_heads + kh * r) * dv;
  for (int j = col; j < r * dv; j += blockDim.x) {
    Window wv;
    load_window(v0 + j, wv);
    vo[j] = conv_silu(wv);
  }
  for (int j = col; j < r; j += blockDim.x) {
    const int h = kh * r + j;
    const size_t nh = (size_t)n * num_v_heads + h;
    g_out[nh] = gate_g(j == col ? a0 : a[nh], dt_bias[h], a_log[h]);
    beta_out[nh] = gate_beta(j == col ? b0 : b[nh]);
  }
}

extern "C" __global__ void __launch_bounds__(1024) gdn_seq_prep4(GDN_PREP_PARAMS) { gdn_seq_prep<4>(GDN_PREP_PASS); }
extern "C" __global__ void __launch_bounds__(1024) gdn_seq_prep8(GDN_PREP_PARAMS) {
  gdn_seq_prep<MAX_TAPS>(GDN_PREP_PASS);
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

// A scan lane's share of a state column at key head size DK ∈ {32, 64, 128, 256}: ROWS = min(DK, 64) rows in
// registers (one GDN_RUN at DK = 32, two from 64 up), PARTS = DK / ROWS lanes a column, COLS = 32 / PARTS columns a
// warp.
template <int DK>
struct ScanShape {
  static_assert(DK == 32 || DK == 64 || DK == 128 || DK == 256, "a scan kernel per key head size 32, 64, 128, 256");
  static constexpr int ROWS = DK < SCAN_ROWS ? DK : SCAN_ROWS, PARTS = DK / ROWS, COLS = SCAN_THREADS / PARTS;
};

// Σ_i S[i, col] · x[i] over the column's DK rows in common.cuh's GDN_RUN order: this lane's ROWS rows as one or two
// fma chains of GDN_RUN rows (interleaved: independent), added; then, with PARTS ≥ 2, the lanes' sums added by xor
// shuffles, level by level (lanes lane_col + j · COLS; fp addition commutes, so every lane gets the same bits):
// ((c0 + c1) + (c2 + c3)) at DK = 128, the pairwise tree of gdn_step at every power-of-two DK. Every lane of the
// column returns the sum.
template <int ROWS, int PARTS, int COLS>
__device__ __forceinline__ float scan_output(const float (&s)[ROWS], const float* qs, int row0, int part,
                                             int lane_col) {
  static_assert((ROWS == GDN_RUN || ROWS == 2 * GDN_RUN) && PARTS * COLS == SCAN_THREADS,
                "a lane holds one or two runs; PARTS lanes a column");
  float c0 = 0.0f, c1 = 0.0f;
#pragma unroll
  for (int i = 0; i < GDN_RUN; ++i) {
    c0 = fmaf(s[i], qs[row0 + i], c0);
    if (ROWS == 2 * GDN_RUN) c1 = fmaf(s[(ROWS - GDN_RUN) + i], qs[row0 + (ROWS - GDN_RUN) + i], c1);
  }
  float out = ROWS == 2 * GDN_RUN ? __fadd_rn(c0, c1) : c0;
#pragma unroll
  for (int off = COLS; off < SCAN_THREADS; off *= 2) out = __fadd_rn(out, __shfl_xor_sync(0xFFFFFFFFu, out, off));
  return out;
}

// One token's delta-rule update of a state column (gdn_step's arithmetic), this lane holding rows row0 ..
// row0 + ROWS - 1: S = S · decay; p = Sᵀk (scan_output's order); S += k · beta (v - p). Shared by the scan
// (prefill, tree, commit) and the decode head kernel, so a decode and a verified node run the same instructions.
template <int ROWS, int PARTS, int COLS>
__device__ __forceinline__ void scan_update(float (&s)[ROWS], const float* ks, int row0, int part, int lane_col,
                                            float decay, float beta, float v) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i) s[i] = __fmul_rn(s[i], decay);
  const float p = scan_output<ROWS, PARTS, COLS>(s, ks, row0, part, lane_col);
  const float delta = __fmul_rn(beta, __fsub_rn(v, p));
#pragma unroll
  for (int i = 0; i < ROWS; ++i) s[i] = __fadd_rn(s[i], __fmul_rn(ks[row0 + i], delta));
}


// The scan's input ring: visit vi's inputs sit in slot vi % SCAN_RING, copied by cp.async SCAN_RING - 1 visits
// ahead, so no visit waits on a load. A slot: k[DK], q[DK], v[SCAN_MAX_WARPS · COLS] (the block's columns), then g,
// beta, restore, save, the node id, 3 words of padding.
#define SCAN_RING 4
#define SCAN_MAX_WARPS 4  // warps a scan block: one column group each
template <int DK>
struct ScanRing {
  static constexpr int COLS = ScanShape<DK>::COLS;
  static constexpr int K = 0, Q = DK, V = 2 * DK, G = 2 * DK + SCAN_MAX_WARPS * COLS, BETA = G + 1, RESTORE = G + 2,
                       SAVE = G + 3, NODE = G + 4;
  static constexpr int STRIDE = G + 8;  // floats; a multiple of 4, so every slot's k, q, v are 16-byte aligned
};

template <int DK>
__device__ __forceinline__ void gdn_scan(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ order,
    const int* __restrict__ stack, int num_visits, float* __restrict__ state, int write_state,
    float* __restrict__ o, float* __restrict__ tail, const float* __restrict__ mixed, int num_rows, int channels,
    int taps, int num_k_heads, int num_v_heads, int dv) {
  // A column's DK rows are split in PARTS pieces of ROWS, one lane each; p and o in scan_output's order
  // (gdn_step's). Warp w of block (h, y) holds column group y · warps + w.
  constexpr int ROWS = ScanShape<DK>::ROWS, PARTS = ScanShape<DK>::PARTS, COLS = ScanShape<DK>::COLS;
  using R = ScanRing<DK>;
  extern __shared__ __align__(16) float scan_smem[];  // ring[SCAN_RING][R::STRIDE], slots[num_slots][warps][ROWS][32]
  float* slots = scan_smem + SCAN_RING * R::STRIDE;
  const int warps = blockDim.x / SCAN_THREADS, tid = threadIdx.x, warp = tid / SCAN_THREADS;
  const int lane = tid % SCAN_THREADS, part = lane / COLS, lane_col = lane % COLS;
  const int h = blockIdx.x, col0 = blockIdx.y * warps * COLS;  // the block's first column
  const int col = col0 + warp * COLS + lane_col, row0 = part * ROWS;
  const int kh = h / (num_v_heads / num_k_heads);
  const size_t tile = (size_t)ROWS * SCAN_THREADS;  // floats of one warp's saved state

  // The entry state, before pdl_wait (common.cuh rule 2: the launch before a scan, gdn_seq_prep or another layer's
  // commit, never writes this layer's state; through L2).
  float s[ROWS];  // rows row0 .. row0 + ROWS - 1 of this thread's state column
  float* s_col = state + ((size_t)h * DK + row0) * dv + col;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) s[i] = __ldcg(s_col + (size_t)i * dv);
  PDL_ENTER
  if (num_rows > 0) shift_tail(tail, mixed, order, num_rows, channels, taps);

  // Visit vi's inputs into ring slot vi % SCAN_RING (node n), as one cp.async group: items [0, DK/4) k's 16-byte
  // pieces, [DK/4, DK/2) q's, then the block's v pieces, then g, beta, restore, save (4 bytes each), the node id.
  const int kq = q ? DK / 2 : DK / 4, vp = warps * COLS / 4, items = kq + vp + 5;
  auto issue = [&](int vi, int n) {
    float* dst = scan_smem + (vi % SCAN_RING) * R::STRIDE;
    const size_t qk = ((size_t)n * num_k_heads + kh) * DK;
    const size_t nh = (size_t)n * num_v_heads + h;
    for (int it = tid; it < items; it += blockDim.x) {
      if (it < kq) {
        const int c = it % (DK / 4);
        cp_async16(smem_u32(dst + (it < DK / 4 ? R::K : R::Q) + 4 * c), (it < DK / 4 ? k : q) + qk + 4 * c, true);
      } else if (it < kq + vp) {
        const int c = it - kq;
        cp_async16(smem_u32(dst + R::V + 4 * c), v + nh * dv + col0 + 4 * c, true);
      } else {
        const int w = it - kq - vp;
        if (w == 4) {
          dst[R::NODE] = __int_as_float(n);  // a plain store: read after the barriers of the visits between
        } else if (w < 2 || stack) {
          const void* src = w == 0 ? (const void*)(g + nh) : w == 1 ? (const void*)(beta + nh)
                                                                    : (const void*)(stack + (w - 2) * num_visits + vi);
          cp_async_small<4>(smem_u32(dst + R::G + w), src);
        }
      }
    }
  };
#pragma unroll
  for (int j = 0; j < SCAN_RING - 1; ++j) {
    if (j < num_visits) issue(j, order ? order[j] : j);
    cp_async_commit();
  }
  constexpr int AHEAD = SCAN_RING - 1;
  int n_ahead = AHEAD < num_visits ? (order ? order[AHEAD] : AHEAD) : 0;  // node of the next visit to issue

  for (int vi = 0; vi < num_visits; ++vi) {
    cp_async_wait<SCAN_RING - 2>();  // this thread's copies of visit vi have landed
    __syncthreads();                 // everyone's have; and slot (vi - 1) % SCAN_RING is no longer read
    if (vi + AHEAD < num_visits) issue(vi + AHEAD, n_ahead);
    cp_async_commit();
    if (vi + AHEAD + 1 < num_visits) n_ahead = order ? order[vi + AHEAD + 1] : vi + AHEAD + 1;

    const float* slot = scan_smem + (vi % SCAN_RING) * R::STRIDE;
    const float* ks = slot + R::K;
    const float* qs = slot + R::Q;
    const int restore = stack ? __float_as_int(slot[R::RESTORE]) : -1;
    const int save = stack ? __float_as_int(slot[R::SAVE]) : -1;
    if (restore >= 0) {
      const float* t = slots + ((size_t)restore * warps + warp) * tile + lane;
#pragma unroll
      for (int i = 0; i < ROWS; ++i) s[i] = t[i * SCAN_THREADS];
    }
    scan_update<ROWS, PARTS, COLS>(s, ks, row0, part, lane_col, expf(slot[R::G]), slot[R::BETA],
                             slot[R::V + warp * COLS + lane_col]);
    if (q) {
      const float out = scan_output<ROWS, PARTS, COLS>(s, qs, row0, part, lane_col);
      const int n = __float_as_int(slot[R::NODE]);
      if (part == PARTS - 1) o[((size_t)n * num_v_heads + h) * dv + col] = out;
    }
    if (save >= 0) {
      float* t = slots + ((size_t)save * warps + warp) * tile + lane;
#pragma unroll
      for (int i = 0; i < ROWS; ++i) t[i * SCAN_THREADS] = s[i];
    }
  }
  if (write_state) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) s_col[(size_t)i * dv] = s[i];
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

// (PDL_ENTER inside gdn_scan, after the entry state's loads.)
extern "C" __global__ void __launch_bounds__(SCAN_MAX_WARPS * SCAN_THREADS) gdn_seq_scan32(GDN_SCAN_ARGS) {
  gdn_scan<32>(GDN_SCAN_PASS);
}

extern "C" __global__ void __launch_bounds__(SCAN_MAX_WARPS * SCAN_THREADS) gdn_seq_scan64(GDN_SCAN_ARGS) {
  gdn_scan<64>(GDN_SCAN_PASS);
}

extern "C" __global__ void __launch_bounds__(SCAN_MAX_WARPS * SCAN_THREADS) gdn_seq_scan128(GDN_SCAN_ARGS) {
  gdn_scan<128>(GDN_SCAN_PASS);
}

extern "C" __global__ void __launch_bounds__(SCAN_MAX_WARPS * SCAN_THREADS) gdn_seq_scan256(GDN_SCAN_ARGS) {
  gdn_scan<256>(GDN_SCAN_PASS);
}

extern "C" __global__ void __launch_bounds__(1024)
gdn_seq_norm(float* __restrict__ y, const float* __restrict__ z, const float* __restrict__ norm_w,
             u16* __restrict__ xs, int dv, int width, int kind, float eps) {
  PDL_ENTER
  __shared__ float scratch[32];
  const size_t idx = (size_t)blockIdx.x * dv + threadIdx.x;
  const float o = y[idx];
  const float inv = 1.0f / sqrtf(block_sum(__fmul_rn(o, o), scratch) / (float)dv + eps);
  const float zz = z[idx];
  const float gate = __fdiv_rn(zz, __fadd_rn(1.0f, expf(-zz)));
  const float out = __fmul_rn(__fmul_rn(norm_w[threadIdx.x], __fmul_rn(o, inv)), gate);
  if (kind != SPLIT_NONE)
    store_split(xs, (int)(idx / width), (int)(idx % width), width, out, kind);
  else
    y[idx] = out;
}

// ---- decode: one token in two launches (gdn_decode_conv, then gdn_decode_head<DK>), gdn_prefill(T = 1)'s bits --

// u = silu(conv) of one token, one thread a channel: gdn_seq_prep's conv_silu with the window [tail rows 0..K-2,
// mixed] (common.cuh conv_silu_shift, which the GDN projection's GEMV epilogue also runs); then the thread's own
// tail column shifts up a row.
extern "C" __global__ void __launch_bounds__(256)
gdn_decode_conv(const float* __restrict__ mixed, float* __restrict__ tail, const float* __restrict__ conv_w,
                float* __restrict__ u, int channels, int taps) {
  PDL_ENTER
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  u[c] = conv_silu_shift(tail, conv_w, channels, taps, c, mixed[c]);  // taps ≥ 2 (the launcher checks)
}

// Sum of the per-thread values `val(t)` of a virtual block of `threads` (a multiple of 32, ≤ 1024) in block_sum's
// order: each 32 consecutive threads by warp_sum, then the warps' sums by warp_sum. Real warp w plays virtual warps
// w, w + num_warps, ...; `partial` (32 floats of shared memory) must not be reused before the next barrier.
// Returns the sum in every thread; contains a __syncthreads (call from every thread of the block).
template <typename F>
__device__ __forceinline__ float emulated_block_sum(F val, int threads, float* partial) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5, vwarps = threads >> 5;
  for (int vw = warp; vw < vwarps; vw += num_warps) {
    const float v = warp_sum(val(vw * 32 + lane));
    if (lane == 0) partial[vw] = v;
  }
  __syncthreads();
  return warp_sum(lane < vwarps ? partial[lane] : 0.0f);
}

template <int DK>
__device__ __forceinline__ void gdn_decode_head(
    const float* __restrict__ u, const float* __restrict__ a, const float* __restrict__ b,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, const float* __restrict__ z,
    const float* __restrict__ norm_w, float* __restrict__ state, float* __restrict__ y, u16* __restrict__ xs,
    int kind, int num_k_heads, int num_v_heads, int dv, float q_scale, float eps, int h) {
  constexpr int ROWS = ScanShape<DK>::ROWS, PARTS = ScanShape<DK>::PARTS, COLS = ScanShape<DK>::COLS;
  __shared__ float qs[DK], ks[DK], os[DECODE_MAX_DV], qraw[DK], kraw[DK];
  __shared__ float partial[3][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int kh = h / (num_v_heads / num_k_heads);
  const float* uq = u + (size_t)kh * DK;
  const float* uk = u + (size_t)(num_k_heads + kh) * DK;
  const float* uv = u + (size_t)2 * num_k_heads * DK + (size_t)h * dv;
  const float* zh = z + (size_t)h * dv;

  // Loads that need nothing computed go first, so their latency overlaps the L2 norms: the warp's first state
  // column group (the column layout of a scan block: PARTS lanes a column, each holding ROWS rows), the
  // gates, and the thread's first z / norm_w element.
  const int part = lane / COLS, lane_col = lane % COLS, row0 = part * ROWS, num_groups = dv / COLS;
  float s[ROWS];
  auto load_state = [&](int grp) {  // through L2 (the first group's loads go out before pdl_wait)
    const float* s_col = state + ((size_t)h * DK + row0) * dv + grp * COLS + lane_col;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) s[i] = __ldcg(s_col + (size_t)i * dv);
  };
  // The first state columns before pdl_wait (common.cuh, PDL, rule 2): the state's last writer (this kernel at the
  // previous token, the scan of a prefill / commit, a cache restore) always comes before the launch right before
  // this one (the in-projection GEMV or gdn_decode_conv). Timed with `python3 bench/ab_decode.py`.
  if (warp < num_groups) load_state(warp);
  const float w0 = threadIdx.x < dv ? norm_w[threadIdx.x] : 0.0f, dt = dt_bias[h], al = a_log[h];
  pdl_wait();
  pdl_launch_dependents();
  // Everything the previous kernel wrote that this block reads goes out at once (one memory round trip, v2.2):
  // q and k into shared memory for the L2 norms, the gates, z, and the v element of the warp's first column group.
  for (int i = threadIdx.x; i < DK; i += blockDim.x) {
    qraw[i] = uq[i];
    kraw[i] = uk[i];
  }
  const float a_h = a[h], b_h = b[h];
  const float z0 = threadIdx.x < dv ? zh[threadIdx.x] : 0.0f;
  const float v_first = warp < num_groups ? uv[warp * COLS + lane_col] : 0.0f;
  __syncthreads();
  const float g = gate_g(a_h, dt, al), beta = gate_beta(b_h);

  // L2 norms as gdn_seq_prep (blockDim = dv): its thread t sums i = t, t + dv, ... < DK with fmaf, then block_sum.
  auto sum_sq = [&](const float* x) {
    return [=](int t) {
      float s = 0.0f;
      for (int i = t; i < DK; i += dv) s = fmaf(x[i], x[i], s);
      return s;
    };
  };
  const float inv_q = 1.0f / sqrtf(emulated_block_sum(sum_sq(qraw), dv, partial[0]) + 1e-6f);
  const float inv_k = 1.0f / sqrtf(emulated_block_sum(sum_sq(kraw), dv, partial[1]) + 1e-6f);
  for (int i = threadIdx.x; i < DK; i += blockDim.x) {
    qs[i] = __fmul_rn(__fmul_rn(qraw[i], inv_q), q_scale);
    ks[i] = __fmul_rn(kraw[i], inv_k);
  }
  __syncthreads();

  // One visit of gdn_scan<DK> per state column: warp w takes the column groups w, w + num_warps, ... of COLS
  // columns, laid out over its lanes as a scan block lays out its columns.
  const float decay = expf(g);
  for (int grp = warp; grp < num_groups; grp += num_warps) {
    const int col = grp * COLS + lane_col;
    if (grp != warp) load_state(grp);
    scan_update<ROWS, PARTS, COLS>(s, ks, row0, part, lane_col, decay, beta, grp == warp ? v_first : uv[col]);
    const float out = scan_output<ROWS, PARTS, COLS>(s, qs, row0, part, lane_col);
    // The store's addresses are recomputed from an opaque copy of the stride: kept live from the loads they
    // would take 64 more registers (and spill at DK = 64).
    int stride;
    asm volatile("mov.b32 %0, %1;" : "=r"(stride) : "r"(dv));
    float* s_out = state + ((size_t)h * DK + row0) * stride + col;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) s_out[(size_t)i * stride] = s[i];
    if (part == PARTS - 1) os[col] = out;
  }
  __syncthreads();

  // Gated RMSNorm as gdn_seq_norm (blockDim = dv, one element a thread, block_sum).
  const float inv = 1.0f / sqrtf(emulated_block_sum([&](int t) { return __fmul_rn(os[t], os[t]); }, dv,
                                                    partial[2]) / (float)dv + eps);
  for (int e = threadIdx.x; e < dv; e += blockDim.x) {
    const float zz = e == threadIdx.x ? z0 : zh[e];
    const float gate = __fdiv_rn(zz, __fadd_rn(1.0f, expf(-zz)));
    const float val = __fmul_rn(__fmul_rn(e == threadIdx.x ? w0 : norm_w[e], __fmul_rn(os[e], inv)), gate);
    if (kind != SPLIT_NONE)
      store_split(xs, 0, h * dv + e, num_v_heads * dv, val, kind);
    else
      y[(size_t)h * dv + e] = val;
  }
}

#define GDN_DECODE_ARGS                                                                                       \
  const float *__restrict__ u, const float *__restrict__ a, const float *__restrict__ b,                      \
      const float *__restrict__ a_log, const float *__restrict__ dt_bias, const float *__restrict__ z,        \
      const float *__restrict__ norm_w, float *__restrict__ state, float *__restrict__ y,                     \
      u16 *__restrict__ xs, int kind, int num_k_heads, int num_v_heads, int dv, float q_scale, float eps
#define GDN_DECODE_PASS \
  u, a, b, a_log, dt_bias, z, norm_w, state, y, xs, kind, num_k_heads, num_v_heads, dv, q_scale, eps

extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head32(GDN_DECODE_ARGS) {
  gdn_decode_head<32>(GDN_DECODE_PASS, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head64(GDN_DECODE_ARGS) {
  gdn_decode_head<64>(GDN_DECODE_PASS, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head128(GDN_DECODE_ARGS) {
  gdn_decode_head<128>(GDN_DECODE_PASS, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head256(GDN_DECODE_ARGS) {
  gdn_decode_head<256>(GDN_DECODE_PASS, blockIdx.x);
}

// ---- several sequences' decode tokens in one launch each (the joint pass; gdn_slots.py) ----
// rows [S] int32: slot s's row of the joint rows (mixed, u, a, b, z, y, xs). tails / states [S] int64: the device
// addresses of slot s's conv tail [K-1, C] and recurrent state [Hv, dk, dv] of this layer. Both tables are written
// long before the launch (once per set of states and rows), so the head kernel may read them before pdl_wait (PDL
// rule 2, through L2).

// gdn_decode_conv_slots grid (ceil(C / 256), S), block 256: gdn_decode_conv's thread c for slot s = blockIdx.y (its
// mixed and u rows, its tail): the same conv_silu_shift, so the same bits.
extern "C" __global__ void __launch_bounds__(256)
gdn_decode_conv_slots(const int* __restrict__ rows, const long long* __restrict__ tails,
                      const float* __restrict__ mixed, int mixed_row_stride, const float* __restrict__ conv_w,
                      float* __restrict__ u, int u_row_stride, int channels, int taps) {
  PDL_ENTER
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int r = rows[blockIdx.y];
  float* tail = reinterpret_cast<float*>(tails[blockIdx.y]);
  u[(size_t)r * u_row_stride + c] =
      conv_silu_shift(tail, conv_w, channels, taps, c, mixed[(size_t)r * mixed_row_stride + c]);
}

// gdn_decode_head_slots<DK> grid (Hv, S), block as gdn_decode_head<DK>: its block h for slot s = blockIdx.y (its u,
// a, b, z rows, its state, its y / xs row) through the same gdn_decode_head<DK>: the bits of that slot's launch.
#define GDN_DECODE_SLOTS_ARGS                                                                                 \
  const int *__restrict__ rows, const long long *__restrict__ states, const float *__restrict__ u,            \
      int u_row_stride, const float *__restrict__ a, const float *__restrict__ b, int ab_row_stride,          \
      const float *__restrict__ a_log, const float *__restrict__ dt_bias, const float *__restrict__ z,        \
      int z_row_stride, const float *__restrict__ norm_w, float *__restrict__ y, int y_row_stride,            \
      u16 *__restrict__ xs, int xs_row_stride, int kind, int num_k_heads, int num_v_heads, int dv,            \
      float q_scale, float eps
template <int DK>
__device__ __forceinline__ void gdn_decode_head_slots(GDN_DECODE_SLOTS_ARGS) {
  const int r = __ldcg(rows + blockIdx.y);
  float* state = reinterpret_cast<float*>(__ldcg(states + blockIdx.y));
  gdn_decode_head<DK>(u + (size_t)r * u_row_stride, a + (size_t)r * ab_row_stride, b + (size_t)r * ab_row_stride,
                      a_log, dt_bias, z + (size_t)r * z_row_stride, norm_w, state,
                      kind == SPLIT_NONE ? y + (size_t)r * y_row_stride : y, kind == SPLIT_NONE ? xs
                                                                                 : xs + (size_t)r * xs_row_stride,
                      kind, num_k_heads, num_v_heads, dv, q_scale, eps, blockIdx.x);
}
#define GDN_DECODE_SLOTS_PASS                                                                                  \
  rows, states, u, u_row_stride, a, b, ab_row_stride, a_log, dt_bias, z, z_row_stride, norm_w, y, y_row_stride, \
      xs, xs_row_stride, kind, num_k_heads, num_v_heads, dv, q_scale, eps
extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head_slots32(GDN_DECODE_SLOTS_ARGS) {
  gdn_decode_head_slots<32>(GDN_DECODE_SLOTS_PASS);  // gdn_decode_head<DK> calls pdl_wait()
}
extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head_slots64(GDN_DECODE_SLOTS_ARGS) {
  gdn_decode_head_slots<64>(GDN_DECODE_SLOTS_PASS);  // gdn_decode_head<DK> calls pdl_wait()
}
extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head_slots128(GDN_DECODE_SLOTS_ARGS) {
  gdn_decode_head_slots<128>(GDN_DECODE_SLOTS_PASS);  // gdn_decode_head<DK> calls pdl_wait()
}
extern "C" __global__ void __launch_bounds__(DECODE_MAX_WARPS * 32) gdn_decode_head_slots256(GDN_DECODE_SLOTS_ARGS) {
  gdn_decode_head_slots<256>(GDN_DECODE_SLOTS_PASS);  // gdn_decode_head<DK> calls pdl_wait()
}
